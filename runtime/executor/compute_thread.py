"""The one thread that runs models: their loading, every forward and every sampling step.

torch's CPU ops split their work over an OpenMP team, and GNU OpenMP keeps one pool of worker
threads per thread that starts a team. Once a process holds more pool threads than it has cores,
libgomp stops spin-waiting between parallel regions (it "throttles" to ~100 spins), so each of the
thousands of small regions in a forward waits for a sleeping worker to wake. A model loaded on one
thread (its probes and calibration start a team there) and run on another pays that wake-up in
every region: a long prefill runs far slower, and decode on two threads runs slower than on one.
With a single pool two threads decode one client faster than one, so every step takes the
process's thread count.

So a runner loads on the compute thread and every step is launched there: the overlap schedule
submits steady decode steps to it and other steps wait for it. Every runner in a process shares
that one thread (`shared()`): engines side by side (benchmarks, tests, a program with two models)
would otherwise each start a pool, and on a CPU their steps compete for the same cores anyway.
Every other thread of ours that runs torch ops (the scheduler loop, snapshot writers) calls
`keep_off_openmp` first: its ops then run on that thread alone and it never starts a pool (the
scheduler's slot bookkeeping over a large KV pool would start one, and every later prefill would pay
the throttling). A caller's own torch work on another thread still starts a pool of its own.
"""

from __future__ import annotations

import _thread
import atexit
import ctypes
import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")
EXIT_TIMEOUT_S = 30.0  # what a step still running at interpreter exit gets to finish


def _openmp_symbol(name: str, argtypes: list, restype) -> Callable | None:
    try:  # dlsym on libtorch's handle also searches what it links (the OpenMP runtime)
        fn = getattr(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")), name)
    except (OSError, AttributeError) as e:
        logger.debug("%s is not reachable: %s", name, e)
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def omp_set_num_threads() -> Callable[[int], None] | None:
    """OpenMP's setter of the calling thread's team size (torch.set_num_threads also changes
    process-wide state); None in a build without an OpenMP runtime reachable from libtorch."""
    return _openmp_symbol("omp_set_num_threads", [ctypes.c_int], None)


def keep_off_openmp() -> None:
    """The calling thread runs its torch ops without an OpenMP team (see the module docstring)."""
    set_threads = omp_set_num_threads()
    if set_threads is not None:
        torch.get_num_threads()  # torch's lazy per-thread setup would reset the count on the first op
        set_threads(1)


class Task:
    """One call queued on a ComputeThread: `result()` waits for it (the concurrent.futures.Future
    calls the scheduler uses: result, done, exception). A decode step hands one over and back each
    step, so it is a lock taken at creation and released when the call ends: a round trip costs
    under half of ThreadPoolExecutor's, whose Future and idle semaphore are Python conditions."""

    __slots__ = ("fn", "args", "_finished", "_value", "_error")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self._finished = _thread.allocate_lock()
        self._finished.acquire()
        self._value: Any = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._value = self.fn(*self.args)
        except BaseException as e:  # handed to whoever waits, as a Future would
            self._error = e
        self.fn = self.args = None  # the call's arguments (a step's batch) are not kept alive by it
        self._finished.release()

    def run_here(self) -> None:
        """Runs the call on the calling thread, for another thread that waits on `result` (the
        scheduler fills a step's grammar masks while the step's launch waits for them)."""
        self._run()

    def done(self) -> bool:
        return not self._finished.locked()

    def _wait(self, timeout: float | None) -> None:
        if not self._finished.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError("the compute thread's call did not finish in time")
        self._finished.release()  # stays finished for every later waiter

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value


class ComputeThread:
    """A single worker thread; `run` calls a function on it (directly when already there)."""

    def __init__(self, name: str = "radixlm-compute") -> None:
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        self.ident = self._thread.ident

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            task._run()

    def on_it(self) -> bool:
        return threading.get_ident() == self.ident

    def submit(self, fn: Callable[..., T], *args: Any) -> Task:
        task = Task(fn, args)
        self._queue.put(task)
        return task

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args) if self.on_it() else self.submit(fn, *args).result()

    def shutdown(self, timeout: float | None = None) -> None:
        """Lets queued work finish, then ends the thread (from another thread; on it, without waiting)."""
        self._queue.put(None)
        if not self.on_it():
            self._thread.join(timeout)


GIL_HANDOFF_S = 0.001


def hand_back_gil_promptly() -> None:
    """For a device that computes on its own (a GPU): the compute thread waits on it with the GIL
    released, and when the step is done it needs the GIL back from the scheduler thread, which
    otherwise keeps it for up to the interpreter's switch interval (5 ms by default, longer than a
    decode step): the device would idle that long. Process-wide, only ever lowered. On a CPU the
    forward is the compute thread's own work and frequent switches only slow it down."""
    if sys.getswitchinterval() > GIL_HANDOFF_S:
        sys.setswitchinterval(GIL_HANDOFF_S)


_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


def shared() -> ComputeThread:
    """The process's compute thread, started on first use and kept for the process's life."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ComputeThread()
        return _shared


def _forget_after_fork() -> None:
    # a forked child has none of its parent's threads: work queued to the parent's compute thread
    # would wait forever, so the child starts its own on first use
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


@atexit.register
def _stop_at_exit() -> None:
    # Finalization ends daemon threads where they next take the GIL: one inside a torch op then
    # unwinds through C++ frames that may not be unwound, and the process aborts ("terminate called
    # without an active exception"). So the thread finishes its queued work and ends before that.
    if _shared is not None:
        _shared.shutdown(timeout=EXIT_TIMEOUT_S)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
