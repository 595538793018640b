"""Per-request state on the HTTP side: one ReqState per generation (the Engine's accumulator plus
where its outputs arrive) and one Group per HTTP request (its generations, read in arrival order)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from radixlm.runtime.output.accumulator import RequestOutput
from radixlm.runtime.request.req import Req
from radixlm.server import messages as m

if TYPE_CHECKING:
    from radixlm.server.tokenizer_manager import TokenizerManager

DISCONNECT_POLL_S = 0.5


class ClientDisconnected(Exception):
    pass


class ReqState(RequestOutput):
    """One generation of an HTTP request: its outputs so far (the Engine's accumulator), its place
    in the request (index) and the queue its outputs arrive on."""

    def __init__(self, req: Req, index: int, queue: asyncio.Queue, stream: bool):
        super().__init__(req)
        self.index = index
        self.queue = queue
        self.stream = stream
        self.t_submit = time.perf_counter()
        self.t_last: float | None = None
        self.timer: asyncio.TimerHandle | None = None  # max_request_seconds

    def meta(self) -> dict[str, Any]:
        meta = super().meta()
        if self.finish is not None:
            meta["e2e_latency"] = (self.t_last or time.perf_counter()) - self.t_submit
        return meta


class Group:
    """The generations of one HTTP request, read in arrival order from one queue. Outputs are
    folded into their ReqState as they are read, so a state shows what the reader has seen."""

    def __init__(self, tm: TokenizerManager, states: list[ReqState], queue: asyncio.Queue):
        self.tm = tm
        self.states = states
        self.queue = queue
        self.unfinished = len(states)
        self._getter: asyncio.Future | None = None

    @property
    def done(self) -> bool:
        return self.unfinished == 0

    async def next(self, request=None) -> tuple[ReqState, m.TextOut]:
        """The next output of any generation; ClientDisconnected if `request`'s client left.
        Pass `request` only while no one else reads its receive channel (not inside a
        StreamingResponse, which watches for the disconnect itself)."""
        while True:
            if self._getter is None:
                self._getter = asyncio.ensure_future(self.queue.get())
            done, _ = await asyncio.wait({self._getter}, timeout=DISCONNECT_POLL_S)
            if done:
                (state, out), self._getter = self._getter.result(), None
                state.add(out, out.text)
                if out.finish is not None:
                    self.unfinished -= 1
                return state, out
            if request is not None and await request.is_disconnected():
                raise ClientDisconnected()

    async def results(self, request=None) -> list[ReqState]:
        try:
            while not self.done:
                await self.next(request)
            return self.states
        finally:
            self.close()

    def close(self) -> None:
        """Aborts whatever has not finished (client gone, error, early exit); idempotent."""
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None
        for s in self.states:
            self.tm.abort(s.rid)
