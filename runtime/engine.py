"""In-process Engine: the scheduler runs on a background thread (the same SchedulerDriver the
server's scheduler process runs, over an in-process queue); generate() may be called from many
threads at once and their requests batch together (this is what the DSL relies on)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixlm.runtime.driver import Abort, Call, QueueTransport, SchedulerDriver, Stop, Submit
from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.output.accumulator import RequestOutput
from radixlm.runtime.request.builder import RequestBuilder, new_rid
from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.req import FinishReason, Req
from radixlm.runtime.scheduler.cache_calls import decode_heads
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.runtime.scheduler.snapshot_file import SnapshotError

logger = logging.getLogger(__name__)
_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()  # engines not shut down yet


@atexit.register
def _shutdown_at_exit() -> None:
    # an Engine the program never shut down stops here, before finalization ends its threads
    # mid-step (the compute thread then stops too: compute_thread._stop_at_exit runs after this)
    for engine in list(_LIVE):
        engine.shutdown()


class Engine:
    def __init__(self, **kwargs: Any):
        self.server_args = EngineArgs.from_kwargs(**kwargs)
        _setup_logging(self.server_args.log_level)
        self.runner = ModelRunner(self.server_args)
        self.tokenizer = self.runner.tokenizer
        self.scheduler = Scheduler(self.server_args, self.runner)
        self.builder = RequestBuilder.from_runner(self.runner)
        self._transport = QueueTransport()
        self._driver = SchedulerDriver(self.scheduler, self.server_args, self._transport)
        self._closed = False
        self._thread = threading.Thread(target=self._driver.run, name="radixlm-scheduler", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ---------------------------------------------------------------- public API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] = -1,
        top_logprobs_num: int | list[int] = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's Engine.generate. Bad input raises RequestError (a ValueError naming the field)."""
        batch = self.builder.build(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                   top_logprobs_num, stream, rid, token_ids_logprob=token_ids_logprob)
        if stream:
            if batch.is_batch or len(batch.groups[0]) > 1:
                raise RequestError("stream", "takes a single prompt with n=1")
            return self._stream(batch.groups[0][0])
        outs = [[RequestOutput(req, self.tokenizer, stream=False) for req in group] for group in batch.groups]
        self._submit(batch.reqs)  # one round: the batch's composition, and so its answers, never vary
        results = [self._wait_group(group) for group in outs]
        if not batch.is_batch:
            for out in outs[0]:
                constraint = out.req.params.constraint
                error = RequestError.from_finish(out.finish, constraint[0] if constraint else None)
                if error is not None:
                    raise error
        return results if batch.is_batch else results[0]

    async def async_generate(self, *args: Any, **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:
        if kwargs.get("stream"):
            return self._astream(self.generate(*args, **kwargs))
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def abort(self, rid: str | None = None) -> None:
        """Aborts one request by id, or every request in flight when rid is None."""
        self._transport.put(Abort(rid))

    def flush_cache(self) -> bool:
        """Empties the radix cache (False while requests run) and the prompt tokenization cache."""
        flushed = self._call("flush_cache")
        if flushed:
            self.builder.token_cache.clear()
        return flushed

    def get_server_info(self) -> dict:
        return self._call("server_info")

    def save_cache(self, path: str | os.PathLike | None = None) -> dict:
        """Saves the hottest part of the radix cache (at most cache_snapshot_max_tokens tokens) with its
        K/V to `path` (default: the cache_snapshot option), atomically; returns the figures (tokens,
        nodes, bytes, seconds). Requests keep running meanwhile. SnapshotError when nothing can be saved
        (no path, the cache disabled, the disk refused)."""
        return _snapshot_record(self._call("cache_save", path=None if path is None else os.fspath(path)))

    def load_cache(self, path: str | os.PathLike | None = None) -> dict:
        """Adds the snapshot at `path` (default: the cache_snapshot option) to the radix cache; returns
        the figures. SnapshotError naming the reason for a snapshot of another model, dtype, tokenizer
        or version, or a truncated or corrupt file: nothing from it is used then."""
        return _snapshot_record(self._call("cache_load", path=None if path is None else os.fspath(path)))

    def cache_info(self, top: int = 10) -> dict:
        """GET /cache's summary of the radix cache (sizes, top prefixes with their text, hit rates,
        evictions, snapshots)."""
        return decode_heads(self._call("cache_summary", top=top), self.tokenizer)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport.put(Stop("engine shut down"))
        self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- plumbing
    def _submit(self, reqs: list[Req]) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")
        for req in reqs:
            self._transport.sinks[req.rid] = queue.SimpleQueue()
        self._transport.put_all([Submit(req) for req in reqs])

    def _wait_group(self, group: list[RequestOutput]) -> dict | list[dict]:
        results = []
        for out in group:
            sink = self._transport.sinks[out.rid]
            try:
                while out.finish is None:
                    out.add(sink.get())
            finally:
                del self._transport.sinks[out.rid]
            results.append(out.to_dict())
        return results if len(results) > 1 else results[0]

    def _stream(self, req: Req) -> Iterator[dict]:
        """Each chunk's text and output_ids so far, as SGLang's Engine streams them (its helpers, such
        as `sglang.utils.stream_and_merge`, trim a chunk against the text before it); only the new ones
        with `incremental_streaming_output`. meta_info is the request's so far either way."""
        out = RequestOutput(req, self.tokenizer)
        incremental = self.server_args.incremental_streaming_output
        self._submit([req])
        sink = self._transport.sinks[req.rid]
        try:
            while out.finish is None:
                step = sink.get()
                text = out.add(step)
                if not (text or step.new_ids or step.finish is not None):
                    continue
                if incremental:
                    yield {"text": text, "output_ids": list(step.new_ids), "meta_info": out.meta()}
                else:
                    yield out.to_dict()
        finally:
            if out.finish is None:
                self.abort(req.rid)
            self._transport.sinks.pop(req.rid, None)

    @staticmethod
    async def _astream(it: Iterator[dict]) -> AsyncIterator[dict]:
        done = object()
        while True:
            chunk = await asyncio.to_thread(next, it, done)
            if chunk is done:
                return
            yield chunk

    def _call(self, name: str, **args: Any) -> Any:
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._transport.put(Call(name, lambda ok, value: reply.put((ok, value)), args))
        ok, value = reply.get()
        if not ok:
            raise RuntimeError(value)
        return value


def _snapshot_record(record: dict) -> dict:
    if not record["ok"]:
        raise SnapshotError(record["message"], record["error"])
    return record


def _setup_logging(level: str) -> None:
    root = logging.getLogger("radixlm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level.upper())


__all__ = ["Engine", "FinishReason", "RequestOutput", "SnapshotError", "new_rid"]
