"""The one scheduler-loop driver, for the in-process Engine and the server's scheduler process.

Loop: take the transport's commands (requests, aborts, control calls, stop) -> `scheduler.step()`
-> hand the step's outputs (and load figures) to the transport. Two transports implement the same
small interface: `QueueTransport` here (the Engine: an in-process queue in, per-request sinks out)
and the server's zmq transport (server/scheduler_process.py). While idle the loop blocks in
`receive` instead of spinning.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.compute_thread import keep_off_openmp
from radixlm.runtime.output.accumulator import make_step_output
from radixlm.runtime.request.req import FinishReason, Req, SchedulerStats, StepOutput
from radixlm.runtime.scheduler.cache_calls import CacheCalls
from radixlm.runtime.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # while idle: how long receive() may block (then the loop checks its peer)
BACKGROUND_WAIT_S = 0.01  # while idle but a snapshot save or load is in flight


# ----------------------------------------------------------------------- commands (transport -> driver)
@dataclass(slots=True)
class Submit:
    req: Req


@dataclass(slots=True)
class Abort:
    rid: str | None  # None: every request in flight


@dataclass(slots=True)
class Call:
    name: str  # a key of SchedulerDriver.calls
    reply: Callable[[bool, Any], None]  # (ok, value or error message)
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the call


@dataclass(slots=True)
class Stop:
    reason: str


class Transport(Protocol):
    def receive(self, timeout: float) -> list:
        """Pending commands; blocks up to `timeout` seconds when there are none."""

    def deliver(self, outputs: list[StepOutput], stats: SchedulerStats | None) -> None: ...

    def peer_alive(self) -> bool:
        """False once whoever feeds the driver is gone (checked before every step: must be cheap)."""


class SchedulerDriver:
    def __init__(self, scheduler: Scheduler, args: EngineArgs, transport: Transport):
        self.scheduler = scheduler
        self.args = args
        self.transport = transport
        # unseeded sampling draws from torch's default generator: seeded once per start-up
        torch.manual_seed(args.random_seed)
        self.cache = CacheCalls(scheduler, args)
        # a call returns its answer, or a Future whose result is replied once done (snapshots)
        self.calls: dict[str, Callable[..., Any]] = {"flush_cache": scheduler.flush_cache,
                                                     "server_info": self.server_info, **self.cache.table()}
        self._later: list[tuple[cf.Future, Callable[[bool, Any], None]]] = []
        self._handlers = {Submit: self._submit, Abort: self._abort, Call: self._call}
        if args.cache_snapshot:  # before the first request: a refused file is logged and we start cold
            self.cache.snapshots.load_now(missing_ok=True)

    def run(self) -> None:
        keep_off_openmp()  # the model runs on the runner's compute thread, and only there
        s = self.scheduler
        busy = False
        try:
            while True:
                background = self._background()
                idle = not s.has_work()
                wait = BACKGROUND_WAIT_S if idle and background else IDLE_WAIT_S if idle else 0.0
                cmds = self.transport.receive(wait)
                if idle and any(isinstance(cmd, Submit) for cmd in cmds):
                    cmds += self._arrivals()
                for cmd in cmds:
                    if isinstance(cmd, Stop):
                        logger.info("scheduler stopping: %s", cmd.reason)
                        self.transport.deliver(s.fail_all(cmd.reason), self.stats())
                        self._save_on_stop()
                        return
                    self._handlers[type(cmd)](cmd)
                if not self.transport.peer_alive():  # checked every step: a busy loop must notice too
                    logger.error("the process feeding the scheduler is gone; exiting")
                    return
                if not s.has_work():
                    if busy:  # report the idle state once, for /metrics
                        self.transport.deliver([], self.stats())
                        busy = False
                    continue
                busy = True
                try:
                    outputs = s.step()
                except Exception:
                    logger.exception("scheduler step failed; aborting in-flight requests")
                    outputs = s.fail_all("internal error in the scheduler step (see server log)", step_failed=True)
                if outputs:
                    self.transport.deliver(outputs, self.stats())
        finally:
            s.grammars.shutdown()

    def _arrivals(self) -> list:
        """Once an idle loop has a request: what arrives while the transport says more are on their
        way (`expecting`), for at most its `gather_max_s`. Requests sent together (a burst of
        clients) reach the scheduler a millisecond or more apart, each through the HTTP process's
        tokenizer threads; the first would start a step at once and the others wait that step out,
        which on the CPU is a prefill of a second or more. Nothing for a transport without them."""
        cmds: list = []
        deadline = time.monotonic() + getattr(self.transport, "gather_max_s", 0.0)
        while getattr(self.transport, "expecting", 0) > 0 and (left := deadline - time.monotonic()) > 0:
            more = self.transport.receive(left)
            if not more:
                break
            cmds += more
            if any(isinstance(cmd, Stop) for cmd in more):
                break
        return cmds

    # ---------------------------------------------------------------- commands
    def _submit(self, cmd: Submit) -> None:
        req = cmd.req
        req.queued_at = time.monotonic()
        try:
            self.scheduler.add_request(req)
        except Exception as e:  # e.g. the grammar backend failed to start: fail this request only
            logger.exception("could not queue request %s", req.rid)
            self.scheduler.live.pop(req.rid, None)
            req.finish = FinishReason("abort", message=f"could not queue the request: {e}")
            self.transport.deliver([make_step_output(req)], None)

    def _abort(self, cmd: Abort) -> None:
        for rid in list(self.scheduler.live) if cmd.rid is None else [cmd.rid]:
            self.scheduler.abort(rid)

    def _call(self, cmd: Call) -> None:
        fn = self.calls.get(cmd.name)
        # a call is answered between steps: a step of requests that all finished is done with first
        if outputs := self.scheduler.settle():
            self.transport.deliver(outputs, self.stats())
        try:
            if fn is None:
                raise KeyError(f"no control call {cmd.name!r}")
            value = fn(**cmd.args)
        except Exception as e:  # reported to the caller
            cmd.reply(False, f"{type(e).__name__}: {e}")
            return
        if isinstance(value, cf.Future):
            self._later.append((value, cmd.reply))
        else:
            cmd.reply(True, value)

    def _background(self) -> bool:
        """Moves snapshot work on and answers the calls that finished; True while some is left."""
        self.cache.snapshots.pump()
        for future, reply in [entry for entry in self._later if entry[0].done()]:
            self._later.remove((future, reply))
            error = future.exception()
            reply(error is None, future.result() if error is None else f"{type(error).__name__}: {error}")
        return self.cache.snapshots.busy or bool(self._later)

    def _save_on_stop(self) -> None:
        """--cache-snapshot: the hottest part of the cache goes to the file before the loop ends."""
        if self.args.cache_snapshot:
            self.cache.snapshots.save_now()  # never raises: a failure is logged and stopping goes on
        self.cache.snapshots.wait()
        self._background()

    # ---------------------------------------------------------------- figures
    def stats(self) -> SchedulerStats:
        s = self.scheduler
        alloc = s.runner.allocator
        cache = s.cache.stats()
        free = alloc.num_free
        return SchedulerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            used_slots=alloc.num_slots - free - cache["evictable_size"],
            cached_slots=cache["evictable_size"],
            total_slots=alloc.num_slots,
            hit_tokens=cache["hit_tokens"],
            query_tokens=cache["query_tokens"],
            forward_passes=s.forward_passes,
            retractions=s.retractions,
        )

    def server_info(self) -> dict[str, Any]:
        """The one server_info builder (Engine.get_server_info and GET /server_info)."""
        s = self.scheduler
        runner = s.runner
        args = {k: v for k, v in dataclasses.asdict(self.args).items() if k != "api_key"}
        return {
            **args,
            "model_path": runner.model_path,
            "context_length": runner.context_len,
            "max_total_tokens": runner.allocator.num_slots,
            "cache": s.cache.stats(),
            "grammar_cache": s.grammars.cache_info(),
            "free_slots": runner.allocator.num_free,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "forward_passes": s.forward_passes,
            "overlapped_steps": s.overlapped_steps,
            "kv_check": s.kv_check,
            "retractions": s.retractions,
            "scheduler_pid": os.getpid(),
        }


# ----------------------------------------------------------------------- the Engine's transport
class QueueTransport:
    """In-process: commands through a queue, each request's outputs into its own sink queue."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.sinks: dict[str, queue.SimpleQueue] = {}
        self._wake = threading.Event()

    def put(self, cmd) -> None:
        self.put_all([cmd])

    def put_all(self, cmds: list) -> None:
        """Commands the driver takes in one receive: an Engine.generate batch joins one scheduling
        round whole, never split by a step that began while it was being queued."""
        self.inbox.put(list(cmds))
        self._wake.set()

    def receive(self, timeout: float) -> list:
        if timeout > 0 and self.inbox.empty():
            self._wake.wait(timeout)
        self._wake.clear()
        cmds = []
        while True:
            try:
                cmds.extend(self.inbox.get_nowait())
            except queue.Empty:
                return cmds

    def deliver(self, outputs: list[StepOutput], stats: SchedulerStats | None) -> None:
        for out in outputs:
            sink = self.sinks.get(out.rid)
            if sink is not None:
                sink.put(out)

    def peer_alive(self) -> bool:
        return True
