"""The scheduler process: the Engine's loop (runtime/engine.py), fed by zmq instead of a queue.

Loop: drain the inbox (requests, aborts, control calls) -> `scheduler.step()` -> send the step's
outputs to the detokenizer. While idle it blocks on the inbox (and checks that its parent lives).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
import os
import signal
import threading
import traceback
from typing import Any

import msgspec
import zmq

from radixlm.runtime.core import FinishReason, Req, StepOutput
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.scheduler import Scheduler
from radixlm.runtime.server_args import ServerArgs
from radixlm.server import messages as m
from radixlm.server.logging_setup import setup_logging

logger = logging.getLogger("radixlm.server.scheduler")

IDLE_POLL_MS = 500  # while idle: how often to look at the parent process


def run_scheduler_process(args_dict: dict, addrs: dict[str, str], ready_conn) -> None:
    """Process entry point. Reports readiness (or the load error) as JSON on `ready_conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the HTTP process stops us
    args = ServerArgs(**args_dict)
    setup_logging(args.log_level, "scheduler")
    try:
        runner = ModelRunner(args)
        scheduler = Scheduler(args, runner)
        loop = SchedulerLoop(scheduler, args, addrs)
    except BaseException as e:
        logger.error("scheduler failed to start: %s", e)
        ready_conn.send_bytes(json.dumps({"ok": False, "error": f"{e}\n{traceback.format_exc()}"}).encode())
        raise SystemExit(1) from e
    ready_conn.send_bytes(json.dumps({
        "ok": True,
        "model_path": runner.model_path,
        "vocab_size": runner.vocab_size,
        "context_len": runner.context_len,
        "pool_size": runner.allocator.num_slots,
    }).encode())
    ready_conn.close()
    # The loop runs on a worker thread, as in the Engine: on the process's main thread the same steps
    # measured 2-4x slower on a busy 2-core machine (an OpenMP spin-wait effect: OMP_WAIT_POLICY=PASSIVE
    # removes it too).
    crashed = []

    def run() -> None:
        try:
            loop.run()
        except BaseException:
            logger.exception("the scheduler loop crashed")
            crashed.append(True)

    worker = threading.Thread(target=run, name="radixlm-scheduler-loop")
    worker.start()
    worker.join()
    if crashed:
        raise SystemExit(1)


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, args: ServerArgs, addrs: dict[str, str]):
        self.scheduler = scheduler
        self.args = args
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(addrs["scheduler"])
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(addrs["detokenizer"])
        self.new_requests: list[m.DetokParams] = []
        self._stop: m.ShutdownReq | None = None
        self._was_busy = False
        self._handlers = {
            m.GenerateReq: self._on_generate,
            m.AbortReq: lambda msg: self.scheduler.abort(msg.rid),
            m.FlushCacheReq: lambda msg: self._reply(msg.call_id, self.scheduler.flush_cache),
            m.ServerInfoReq: lambda msg: self._reply(msg.call_id, self.server_info),
            m.ShutdownReq: self._on_shutdown,
        }

    def run(self) -> None:
        s = self.scheduler
        parent = multiprocessing.parent_process()
        try:
            while self._stop is None:
                if self.inbox.poll(0 if s.has_work() else IDLE_POLL_MS):
                    self._drain_inbox()
                if self._stop is not None:
                    break
                if not s.has_work():
                    if self._was_busy:  # report the idle state once, for /metrics
                        self._send([], stats=True)
                        self._was_busy = False
                    if parent is not None and not parent.is_alive():
                        logger.error("parent process is gone; scheduler exiting")
                        return
                    continue
                self._was_busy = True
                try:
                    outputs = s.step()
                except Exception:
                    logger.exception("scheduler step failed; aborting in-flight requests")
                    outputs = s.fail_all("internal error in the scheduler step (see server log)")
                if outputs:
                    self._send(outputs, stats=True)
            self._send(s.fail_all(self._stop.reason), stats=True)
            self.outbox.send(m.encode(self._stop))  # the detokenizer exits on it
        finally:
            grammars = getattr(s, "grammars", None)
            if grammars is not None:
                grammars.shutdown()
            self.inbox.close(linger=0)
            self.outbox.close(linger=1000)
            self.ctx.term()

    # ---------------------------------------------------------------- inbox
    def _drain_inbox(self) -> None:
        while self._stop is None:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = m.decode(data)
            except Exception as e:  # never crash on a malformed message; answer it if it names a request
                logger.error("malformed message (%d bytes): %s", len(data), e)
                self._refuse(_rid_of(data), f"malformed request: {e}")
                continue
            handler = self._handlers.get(type(msg))
            if handler is None:
                logger.error("unexpected message for the scheduler: %s", type(msg).__name__)
                continue
            try:
                handler(msg)
            except Exception as e:
                logger.exception("handling %s failed", type(msg).__name__)
                if isinstance(msg, m.GenerateReq):
                    self._refuse(msg.rid, f"the scheduler could not take the request: {e}", code=500)

    def _on_generate(self, msg: m.GenerateReq) -> None:
        req = Req(rid=msg.rid, input_ids=msg.input_ids, params=msg.params, return_logprob=msg.return_logprob,
                  logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                  stream=msg.stream)
        p = msg.params
        self.scheduler.add_request(req)  # may back off the prompt's last token (token healing)
        strip = req.healing.text if req.healing is not None else ""
        self.new_requests.append(m.DetokParams(msg.rid, list(p.stop), p.skip_special_tokens, p.no_stop_trim, strip))

    def _refuse(self, rid: str | None, message: str, code: int = 400) -> None:
        """Finishes a request that never reached the scheduler with an abort, so no one waits for it."""
        if rid is None:
            return
        live = getattr(self.scheduler, "live", None)  # add_request may have registered it before failing
        if live is not None:
            live.pop(rid, None)
        out = StepOutput(rid, [], FinishReason("abort", message=message, code=code), 0, 0, 0)
        self.new_requests.append(m.DetokParams(rid))
        self._send([out], stats=False)

    def _on_shutdown(self, msg: m.ShutdownReq) -> None:
        logger.info("scheduler shutting down: %s", msg.reason)
        self._stop = msg

    def _reply(self, call_id: int, fn) -> None:
        try:
            reply = m.ControlReply(call_id, ok=True, value=fn())
        except Exception as e:  # reported to the caller
            reply = m.ControlReply(call_id, ok=False, error=f"{type(e).__name__}: {e}")
        self.outbox.send(m.encode(reply))

    # ---------------------------------------------------------------- outbox
    def _send(self, outputs: list[StepOutput], stats: bool) -> None:
        # detokenization parameters travel ahead of (or with) the request's first output
        batch = m.TokenBatch(outputs=outputs, new_requests=self.new_requests,
                             stats=self.stats() if stats else None)
        self.new_requests = []
        self.outbox.send(m.encode(batch))

    def stats(self) -> m.SchedulerStats:
        s = self.scheduler
        alloc = s.runner.allocator
        cache = s.cache.stats()
        grammars = getattr(s, "grammars", None)
        compiling = len(grammars.pending) if grammars is not None else 0
        return m.SchedulerStats(
            num_running=s.num_running,
            num_waiting=len(s.waiting) + compiling,
            used_slots=alloc.num_slots - alloc.num_free,
            total_slots=alloc.num_slots,
            hit_tokens=cache["hit_tokens"],
            query_tokens=cache["query_tokens"],
            forward_passes=s.forward_passes,
        )

    def server_info(self) -> dict[str, Any]:
        s = self.scheduler
        runner = s.runner
        args = {f.name: getattr(self.args, f.name) for f in dataclasses.fields(self.args) if f.name != "api_key"}
        return {
            **args,
            "model_path": runner.model_path,
            "context_length": runner.context_len,
            "max_total_tokens": runner.allocator.num_slots,
            "cache": s.cache.stats(),
            "free_slots": runner.allocator.num_free,
            "num_running": s.num_running,
            "num_waiting": len(s.waiting),
            "forward_passes": s.forward_passes,
            "retractions": s.retractions,
            "scheduler_pid": os.getpid(),
        }


def _rid_of(data: bytes) -> str | None:
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:
        return None
    rid = raw.get("rid") if isinstance(raw, dict) and raw.get("type") == "GenerateReq" else None
    return rid if isinstance(rid, str) else None
