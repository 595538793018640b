"""In-process Engine: the scheduler runs on a background thread; generate() may be called from
many threads at once and their requests batch together (this is what the DSL relies on)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixlm.runtime.core import FinishReason, StepOutput
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.req_output import make_step_output
from radixlm.runtime.request_builder import RequestBuilder, RequestResult, new_rid
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        _setup_logging(self.server_args.log_level)
        self.runner = ModelRunner(self.server_args)
        self.tokenizer = self.runner.tokenizer
        self.scheduler = Scheduler(self.server_args, self.runner)
        self.builder = RequestBuilder.from_runner(self.runner)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, queue.SimpleQueue] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="radixlm-scheduler", daemon=True)
        self._thread.start()

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
    ) -> dict | list[dict] | Iterator[dict]:
        batch = self.builder.build(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                                   top_logprobs_num, stream, rid)
        if stream:
            if batch.is_batch or len(batch.groups[0]) > 1:
                raise ValueError("stream=True takes a single prompt with n=1")
            return self._stream(batch.groups[0][0])
        results = [self._wait_group(group) for group in self._submit_all(batch.groups)]
        if not batch.is_batch:
            for _, result in batch.groups[0]:
                if result.last.finish.code == 400:  # e.g. a grammar that failed to compile
                    raise ValueError(result.last.finish.message)
        return results if batch.is_batch else results[0]

    async def async_generate(self, *args: Any, **kwargs: Any) -> dict | list[dict] | AsyncIterator[dict]:
        if kwargs.get("stream"):
            return self._astream(self.generate(*args, **kwargs))
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))
        self._wake.set()

    def flush_cache(self) -> bool:
        return self._call(self.scheduler.flush_cache)

    def get_server_info(self) -> dict:
        def info() -> dict:
            s = self.scheduler
            return {
                **{k: v for k, v in _asdict(self.server_args).items() if k != "api_key"},
                "model_path": self.runner.model_path,
                "context_length": self.runner.context_len,
                "max_total_tokens": self.runner.allocator.num_slots,
                "cache": s.cache.stats(),
                "free_slots": self.runner.allocator.num_free,
                "num_running": s.num_running,
                "num_waiting": len(s.waiting),
                "forward_passes": s.forward_passes,
                "retractions": s.retractions,
            }
        return self._call(info)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(("stop", None))
        self._wake.set()
        self._thread.join(timeout=30)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- plumbing
    def _submit_all(self, groups):
        if self._closed:
            raise RuntimeError("engine is shut down")
        out = []
        for group in groups:
            for req, _ in group:
                self._sinks[req.rid] = queue.SimpleQueue()
                self._inbox.put(("req", req))
            out.append(group)
        self._wake.set()
        return out

    def _wait_group(self, group) -> dict | list[dict]:
        results = []
        for req, result in group:
            sink = self._sinks[req.rid]
            while True:
                step: StepOutput = sink.get()
                result.add(step)
                if step.finish is not None:
                    break
            del self._sinks[req.rid]
            results.append(result.to_dict())
        return results if len(results) > 1 else results[0]

    def _stream(self, item) -> Iterator[dict]:
        req, result = item
        self._submit_all([[item]])
        sink = self._sinks[req.rid]
        finished = False
        try:
            while not finished:
                step = sink.get()
                chunk = result.add(step)
                finished = step.finish is not None
                if chunk["text"] or chunk["output_ids"] or finished:
                    yield chunk
        finally:
            if not finished:
                self.abort(req.rid)
            self._sinks.pop(req.rid, None)

    @staticmethod
    async def _astream(it: Iterator[dict]) -> AsyncIterator[dict]:
        done = object()
        while True:
            chunk = await asyncio.to_thread(next, it, done)
            if chunk is done:
                return
            yield chunk

    def _call(self, fn):
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(("call", (fn, reply)))
        self._wake.set()
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        s = self.scheduler
        while True:
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "stop":
                    for out in s.fail_all("engine shut down"):
                        self._deliver(out)
                    s.grammars.shutdown()
                    return
                if kind == "req":
                    try:
                        s.add_request(payload)
                    except Exception as e:  # e.g. the grammar backend failed to start
                        logger.exception("could not queue request %s", payload.rid)
                        s.live.pop(payload.rid, None)
                        payload.finish = FinishReason("abort", message=f"could not queue the request: {e}")
                        self._deliver(make_step_output(payload))
                elif kind == "abort":
                    s.abort(payload)
                elif kind == "call":
                    fn, reply = payload
                    try:
                        reply.put((True, fn()))
                    except Exception as e:  # reported to the caller
                        reply.put((False, e))
            if not s.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = s.step()
            except Exception:
                logger.exception("scheduler step failed; aborting in-flight requests")
                outputs = s.fail_all("internal error in the scheduler step (see server log)")
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        sink = self._sinks.get(out.rid)
        if sink is not None:
            sink.put(out)


def _asdict(args: ServerArgs) -> dict:
    import dataclasses

    return dataclasses.asdict(args)


def _setup_logging(level: str) -> None:
    root = logging.getLogger("radixlm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level.upper())


__all__ = ["Engine", "FinishReason", "RequestResult", "new_rid"]
