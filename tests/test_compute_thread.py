"""executor/compute_thread.py: the model loads and runs on one thread, and the scheduler's own thread
never starts an OpenMP team (two pools in one process throttle libgomp's spin-wait)."""

from __future__ import annotations

import ctypes
import threading
import weakref

import pytest
import torch

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor import compute_thread as ct
from radixlm.runtime.executor.model_runner import ModelRunner

_get = ct._openmp_symbol("omp_get_max_threads", [], ctypes.c_int)
needs_openmp = pytest.mark.skipif(_get is None or ct.omp_set_num_threads() is None,
                                  reason="no OpenMP runtime reachable from libtorch")


def _on_a_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


def test_run_calls_on_the_thread_and_directly_when_already_there():
    compute = ct.ComputeThread("test-compute")
    try:
        assert compute.run(threading.get_ident) == compute.ident != threading.get_ident()
        assert compute.run(lambda: compute.run(threading.get_ident)) == compute.ident  # no self-deadlock
        with pytest.raises(ZeroDivisionError):
            compute.run(lambda: 1 / 0)
        assert compute.submit(lambda: 7).result() == 7
    finally:
        compute.shutdown()
    assert not any(t.ident == compute.ident for t in threading.enumerate())


def test_a_task_waits_raises_and_lets_go_of_its_arguments():
    """The Future calls the scheduler makes on a launched step: result (with a timeout), done,
    exception; every waiter sees the same outcome, and a finished task holds no argument (a batch)."""
    compute = ct.ComputeThread("test-compute")
    gate = threading.Event()
    try:
        held = compute.submit(gate.wait)
        assert not held.done()
        with pytest.raises(TimeoutError):
            held.result(timeout=0.05)
        gate.set()
        assert held.result() is True and held.result() is True and held.done()
        assert held.exception() is None

        class Arg:
            pass

        failed = compute.submit(lambda: 1 / 0)
        assert isinstance(failed.exception(), ZeroDivisionError)
        with pytest.raises(ZeroDivisionError):
            failed.result()
        arg = Arg()
        finalized = threading.Event()
        weakref.finalize(arg, finalized.set)
        done = compute.submit(lambda a: None, arg)
        assert done.result() is None
        del arg
        assert finalized.is_set()  # the task let go of it when its call ended
    finally:
        compute.shutdown()


@needs_openmp
def test_keep_off_openmp_sets_only_the_calling_threads_team():
    def off() -> int:
        ct.keep_off_openmp()
        torch.ones(1 << 20).add_(1)  # a parallel op after it must not bring the count back
        return _get()

    assert _on_a_thread(off) == 1
    assert _on_a_thread(_get) == torch.get_num_threads()  # a fresh thread still gets the process's count


@needs_openmp
def test_every_step_runs_on_the_compute_thread_and_the_loop_keeps_off_openmp(make_tiny_model, monkeypatch):
    from radixlm.runtime import Engine
    from radixlm.runtime.scheduler.scheduler import Scheduler

    seen: dict[str, set] = {"forward": set(), "loop": set()}
    forward, schedule = ModelRunner.forward, Scheduler.schedule

    def recording_forward(self, batch):
        seen["forward"].add((threading.get_ident(), str(batch.mode)))
        return forward(self, batch)

    def recording_schedule(self):
        seen["loop"].add((threading.get_ident(), _get()))
        return schedule(self)

    monkeypatch.setattr(ModelRunner, "forward", recording_forward)
    monkeypatch.setattr(Scheduler, "schedule", recording_schedule)
    for overlap in (True, False):
        seen["forward"].clear(), seen["loop"].clear()
        with Engine(model=str(make_tiny_model()), log_level="warning", disable_overlap_schedule=not overlap) as e:
            e.generate(["one two", "three four five"], {"max_new_tokens": 6, "ignore_eos": True})
            compute = e.runner.compute.ident
        assert {t for t, _ in seen["forward"]} == {compute}
        assert {m for _, m in seen["forward"]} == {"ForwardMode.EXTEND", "ForwardMode.DECODE"}
        assert {n for _, n in seen["loop"]} == {1} and compute not in {t for t, _ in seen["loop"]}


def test_runners_share_the_one_compute_thread_and_a_failed_load_leaves_no_thread(make_tiny_model, tmp_path):
    """Two runners in a process load and run on the same thread (one OpenMP pool), and a load that
    fails starts no thread of its own."""
    folder = make_tiny_model()
    first = ModelRunner(EngineArgs(model=str(folder), max_total_tokens=256, log_level="warning"))
    before = {t.ident for t in threading.enumerate()}
    second = ModelRunner(EngineArgs(model=str(folder), max_total_tokens=256, log_level="warning"))
    assert first.compute is second.compute is ct.shared()
    with pytest.raises(Exception, match="cannot load|not a|No such|does not exist"):
        ModelRunner(EngineArgs(model=str(tmp_path / "missing"), log_level="warning"))
    assert {t.ident for t in threading.enumerate()} <= before


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_compute_thread():
    """The parent's compute thread does not exist in a forked child: work queued to it would hang."""
    import os

    parent = ct.shared()
    assert parent.run(lambda: 6 * 7) == 42
    pid = os.fork()
    if pid == 0:  # the child: exits 0 only if its own thread ran the work
        code = 1
        try:
            child = ct.shared()
            code = 0 if child is not parent and child.submit(lambda: 42).result(timeout=20) == 42 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ct.shared() is parent
