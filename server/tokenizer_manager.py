"""The HTTP process's side of the runtime: validation, tokenization, per-request state, fan-out.

Request lifecycle (one HTTP request = one Group of generations, n samples x prompts):
  (ReqState and Group live in request_state.py)
  1. a route turns the body into Reqs with RequestBuilder (the Engine's validation, same messages)
  2. `submit(reqs)` checks the queue bound, registers a ReqState per Req, sends GenerateReqs
  3. `_recv_loop` takes TextBatches from the detokenizer, folds each TextOut into its ReqState and
     puts it on the group's queue; a finished state leaves the table
  4. the route awaits `group.results()` or iterates `group.events()`; leaving early (client gone,
     error, cancel) aborts the unfinished generations, which frees their KV slots
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from radixlm.runtime.executor.loader import load_tokenizer
from radixlm.runtime.request.builder import RequestBuilder
from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.reasoning import REASONING_FORMATS, thinking_tokens
from radixlm.runtime.request.req import FinishReason, Req, SchedulerStats
from radixlm.server import messages as m
from radixlm.server.errors import APIError
from radixlm.server.metrics import Metrics
from radixlm.server.request_state import ClientDisconnected, Group, ReqState
from radixlm.server.server_args import ServerArgs
from radixlm.server.tool_calls import tool_format

__all__ = ["ClientDisconnected", "Group", "ReqState", "TokenizerManager"]

logger = logging.getLogger("radixlm.server.tokenizer_manager")

RETRY_AFTER_S = 1
LARGE_BODY_BYTES = 64 * 1024  # bodies past this are tokenized on their own threads, never beside small ones


class Arrivals:
    """The generation requests received and not yet sent to the scheduler. Each GenerateReq carries
    how many are still on their way (`pending`), so that an idle CPU scheduler waits for the rest of
    a burst of clients (driver.SchedulerDriver._arrivals), and never for a request that is not coming.
    A request counts from its arrival (app.CountArrivals) until its submission or its answer."""

    PATHS = frozenset({"/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses"})
    KEY = "radixlm.on_its_way"  # in the request's ASGI scope, which its handler's Request shares

    def __init__(self) -> None:
        self.count = 0

    def begin(self, scope: dict) -> None:
        if not scope.get(self.KEY):
            scope[self.KEY] = True
            self.count += 1

    def end(self, scope: dict) -> None:
        if scope.get(self.KEY):
            scope[self.KEY] = False
            self.count -= 1


class TokenizerManager:
    def __init__(self, args: ServerArgs, info: dict[str, Any], addrs: dict[str, str], metrics: Metrics,
                 tokenizer: Any = None):
        self.args = args
        self.model_path = info["model_path"]
        self.context_len: int = info["context_len"]
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_path, args.chat_template)
        self.builder = RequestBuilder(self.tokenizer, info["vocab_size"], info["context_len"], info["pool_size"])
        # --reasoning-parser: the thinking block's format, and its tags' token ids when each is one token
        # (a constraint then waits for the end of the thinking; otherwise it judges the whole output)
        self.tool_format = tool_format(args.tool_call_parser, self.tokenizer)  # --tool-call-parser (auto)
        self.reasoning = REASONING_FORMATS.get(args.reasoning_parser or "")
        self.thinking_tokens = thinking_tokens(self.tokenizer, self.reasoning) if self.reasoning else None
        if self.reasoning is not None and self.thinking_tokens is None:
            logger.warning("--reasoning-parser %s: this tokenizer spells %s or %s in several tokens, so a constraint "
                           "judges the whole output, thinking included", self.reasoning.name, self.reasoning.start,
                           self.reasoning.end)
        self.metrics = metrics
        self.max_in_flight = args.max_running_requests + args.max_queued_requests
        self.arrivals = Arrivals()
        self.states: dict[str, ReqState] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.stats = SchedulerStats(total_slots=info["pool_size"])
        # set when a child process died (until resume(), once it is restarted) or the drain expired: every
        # request fails
        self.failed: str | None = None
        self.started = time.time()
        self.last_heard = time.monotonic()  # the last message from the scheduler (through the detokenizer)
        self._addrs = addrs
        self._ctx: zmq.asyncio.Context | None = None
        self._recv_task: asyncio.Task | None = None
        self._closed = False
        # chat templates and tokenization run off the event loop (a 600 kB prompt takes a second);
        # large bodies get their own threads so they never queue ahead of small ones
        self._small_pool = cf.ThreadPoolExecutor(4, thread_name_prefix="radixlm-tok")
        self._large_pool = cf.ThreadPoolExecutor(2, thread_name_prefix="radixlm-tok-large")

    # ---------------------------------------------------------------- lifecycle (on the event loop)
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._to_scheduler = self._ctx.socket(zmq.PUSH)
        self._to_scheduler.connect(self._addrs["scheduler"])
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.bind(self._addrs["tokenizer"])
        self._recv_task = asyncio.create_task(self._recv_loop(), name="radixlm-tm-recv")

    async def stop(self) -> None:
        self._closed = True  # handlers still unwinding may abort: never send on a closed socket
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self._ctx is not None:
            self._to_scheduler.close(linger=0)
            self._inbox.close(linger=0)
            self._ctx.term()
        self._small_pool.shutdown(wait=False, cancel_futures=True)
        self._large_pool.shutdown(wait=False, cancel_futures=True)

    async def drain(self, timeout: float) -> None:
        """SIGTERM: lets in-flight generations finish for `timeout` seconds, then ends the rest with a
        503 so every client still gets a well-formed final answer before the server exits."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.states and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.states:
            logger.warning("drain window of %gs expired: ending %d generation(s)", timeout, len(self.states))
            self.fail_all(f"the server is shutting down and this request did not finish within the drain "
                          f"window ({timeout:g}s)", code=503)

    def fail_all(self, message: str, code: int = 500) -> None:
        """A child died or the drain expired: ends every waiting request with an abort carrying `code`
        and tells the scheduler to drop them."""
        self.failed = message
        if self.states:
            self.abort(None)
        for state in list(self.states.values()):
            self._finish_here(state, message, code)
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(APIError(503, message))

    def resume(self) -> None:
        """The children were restarted after a death (launch.py): requests are accepted again."""
        self.failed = None
        self.stats = SchedulerStats(total_slots=self.stats.total_slots)
        self.last_heard = time.monotonic()

    def scheduler_stalled(self) -> float | None:
        """Seconds since the scheduler loop was last heard from, if that is past --health-stall-timeout: a
        healthy loop sends at least every messages.HEARTBEAT_S, so only a stuck (or very slow) step gets here."""
        silent = time.monotonic() - self.last_heard
        return silent if silent > max(self.args.health_stall_timeout, 2 * m.HEARTBEAT_S) else None

    def _finish_here(self, state: ReqState, message: str, code: int) -> None:
        """Finishes a generation from this side (the scheduler's own finish for it is then ignored)."""
        self._deliver(m.TextOut(rid=state.rid, text="", new_ids=[], finish=FinishReason("abort", message=message,
                                                                                       code=code),
                                prompt_tokens=len(state.req.input_ids), completion_tokens=len(state.output_ids),
                                cached_tokens=0))

    def _expire(self, rid: str) -> None:
        state = self.states.get(rid)
        if state is not None:
            self.abort(rid)
            limit = self.args.max_request_seconds
            self._finish_here(state, f"the request ran past max_request_seconds ({limit:g}s) and was stopped; "
                                     "ask for fewer tokens (max_tokens)", 504)

    async def run_blocking(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a tokenizer thread (chat template, tokenization, validation)."""
        pool = self._large_pool if size > LARGE_BODY_BYTES else self._small_pool
        return await asyncio.get_running_loop().run_in_executor(pool, _refusing_lightly, fn, *args)

    # ---------------------------------------------------------------- requests
    def submit(self, reqs: list[Req], stream: bool = False, scope: dict | None = None) -> Group:
        """Registers and sends the generations; 503 (with Retry-After) when the queue is full.
        All or nothing: a request that fails here leaves no state behind. ``scope``: the HTTP
        request's, which stops counting as on its way (Arrivals)."""
        if scope is not None:
            self.arrivals.end(scope)
        if self.failed or self._closed:
            raise APIError(503, self.failed or "server is shutting down")
        if len(self.states) + len(reqs) > self.max_in_flight:
            raise APIError(503, f"server is busy: {len(self.states)} generations in flight, the limit is "
                                f"{self.max_in_flight} (max_running_requests + max_queued_requests); retry later",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        rids = [r.rid for r in reqs]
        taken = [rid for rid in rids if rid in self.states]
        if taken or len(set(rids)) != len(rids):
            raise APIError(400, f"rid {(taken or rids)[0]!r} is already in use by a request in flight", param="rid")
        # encode everything before registering anything (values were bounded by validation)
        frames = []
        for i, req in enumerate(reqs):
            req.stream = stream
            frames.append(m.encode(m.GenerateReq(
                rid=req.rid, input_ids=req.input_ids, params=req.params, return_logprob=req.return_logprob,
                logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num, stream=stream,
                after_thinking=req.after_thinking, token_ids_logprob=req.token_ids_logprob,
                pending=self.arrivals.count + len(reqs) - 1 - i,
            )))
        queue: asyncio.Queue = asyncio.Queue()
        states = [ReqState(req, i, queue, stream) for i, req in enumerate(reqs)]
        sent = 0
        try:
            for state, frame in zip(states, frames):
                self.states[state.rid] = state
                self._to_scheduler.send(frame)
                sent += 1
        finally:
            for state in states[sent:]:  # never sent: nothing will ever finish them
                self.states.pop(state.rid, None)
        self.metrics.in_flight.set(len(self.states))
        if self.args.max_request_seconds:
            loop = asyncio.get_running_loop()
            for state in states:
                state.timer = loop.call_later(self.args.max_request_seconds, self._expire, state.rid)
        return Group(self, states, queue)

    def abort(self, rid: str | None) -> None:
        """Aborts one generation (if in flight), or every one when rid is None (abort_all)."""
        if (rid is None or rid in self.states) and self._ctx is not None and not self._closed:
            self._to_scheduler.send(m.encode(m.AbortReq(rid)))

    async def call(self, name: str, timeout: float = 60.0, **args: int) -> Any:
        """A control call answered by the scheduler ("flush_cache", "server_info", "cache_summary", ...)."""
        if self.failed or self._closed:
            raise APIError(503, self.failed or "server is shutting down")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.calls[call_id] = fut
        try:
            self._to_scheduler.send(m.encode(m.ControlReq(call_id, name, args)))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as e:
            raise APIError(503, f"the scheduler did not answer {name} within {timeout:.0f}s") from e
        finally:
            self.calls.pop(call_id, None)

    # ---------------------------------------------------------------- receiving
    async def _recv_loop(self) -> None:
        while True:
            data = await self._inbox.recv()
            self.last_heard = time.monotonic()
            try:
                msg = m.decode(data)
            except Exception as e:
                logger.error("dropping a malformed message (%d bytes): %s", len(data), e)
                continue
            if isinstance(msg, m.TextBatch):
                for out in msg.outputs:
                    self._deliver(out)
                if msg.stats is not None:
                    self.stats = msg.stats
                    self.metrics.update_scheduler(msg.stats)
                self.metrics.in_flight.set(len(self.states))
            elif isinstance(msg, m.ControlReply):
                fut = self.calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    if msg.ok:
                        fut.set_result(msg.value)
                    else:
                        fut.set_exception(APIError(500, msg.error or "control call failed"))
            else:
                logger.error("unexpected message for the tokenizer manager: %s", type(msg).__name__)

    def _deliver(self, out: m.TextOut) -> None:
        state = self.states.get(out.rid)
        if state is None:
            return
        now = time.perf_counter()
        metrics = self.metrics
        if out.new_ids:
            if state.t_last is None:
                metrics.first_token(now - state.t_submit)
            else:  # streamed steps, or the rest of a non-streamed reply after its first token
                gap = (now - state.t_last) / len(out.new_ids)
                for _ in out.new_ids:
                    metrics.itl.observe(gap)
        if out.queue_time is not None:
            metrics.queue.observe(out.queue_time)
        if out.new_ids or out.finish is not None:
            state.t_last = now
        if out.finish is not None:
            del self.states[out.rid]
            if state.timer is not None:
                state.timer.cancel()
            metrics.e2e.observe(now - state.t_submit)
            metrics.finished(out.finish.type)
            metrics.prompt_tokens.inc(out.prompt_tokens)
            metrics.cached_tokens.inc(out.cached_tokens)
            metrics.generation_tokens.inc(out.completion_tokens)
        state.queue.put_nowait((state, out))


def _refusing_lightly(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args); a refusal (APIError, RequestError) leaves without its traceback. The traceback's frames
    hold what fn built from the request (a decoded body, thousands of messages or tools): dropped here,
    they are freed on this thread, not on the event loop that receives the error."""
    try:
        return fn(*args)
    except (APIError, RequestError) as e:
        e.__cause__ = e.__context__ = None
        raise e.with_traceback(None) from None
