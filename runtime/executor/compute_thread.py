"""The one thread that runs a model: its loading, every forward and every sampling step.

torch's CPU ops split their work over an OpenMP team, and GNU OpenMP keeps one pool of worker
threads per thread that starts a team. Once a process holds more pool threads than it has cores,
libgomp stops spin-waiting between parallel regions (it "throttles" to ~100 spins), so each of the
thousands of small regions in a forward waits for a sleeping worker to wake. When a model was
loaded on one thread (its probes and calibration start a team there) and run on another, that is
what happened: a 1,700-token int8 prefill took 3.2 s on the scheduler's thread and 1.9 s on the
thread that loaded the model, on the same 2-vCPU machine (`benchmarks/README.md`, "One thread runs
the model"). So the runner loads on a thread of its own and every step is launched there: the
overlap schedule submits steady decode steps to it and other steps wait for it. Every other thread
of ours that runs torch ops (the scheduler loop, snapshot writers) calls `keep_off_openmp` first:
its ops then run on that thread alone and it never starts a pool (the scheduler's slot bookkeeping
over a 46,000-slot pool did, and the next prefill took 3.6 s instead of 1.9 s).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def keep_off_openmp() -> None:
    """The calling thread runs its torch ops without an OpenMP team (see the module docstring)."""
    from radixlm.runtime.executor.step_threads import _omp_setter

    set_threads = _omp_setter()
    if set_threads is not None:
        torch.get_num_threads()  # torch's lazy per-thread setup would reset the count on the first op
        set_threads(1)


class ComputeThread:
    """A single worker thread; `run` calls a function on it (directly when already there)."""

    def __init__(self, name: str = "radixlm-compute") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.ident = self._pool.submit(threading.get_ident).result()

    def on_it(self) -> bool:
        return threading.get_ident() == self.ident

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args) if self.on_it() else self._pool.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Lets queued work finish, then ends the thread (from another thread; a no-op on it)."""
        if not self.on_it():
            self._pool.shutdown(wait=True)
