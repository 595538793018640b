"""executor/step_threads.py: int8 decode steps run on one OpenMP thread, set on the forward's thread
only; prefill steps, float32 and every other thread keep the process's count."""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

from radixlm.runtime.executor.step_threads import (
    INT8_DECODE_THREADS,
    StepThreads,
    _libtorch_symbol,
    _mkl_local_setter,
    _omp_setter,
)

CPU = torch.device("cpu")
needs_threads = pytest.mark.skipif(torch.get_num_threads() == INT8_DECODE_THREADS or _omp_setter() is None,
                                   reason="needs more than one torch thread and a reachable OpenMP runtime")


def _on_a_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


@needs_threads
def test_int8_decode_steps_run_on_one_thread_and_prefill_on_the_process_count():
    default = torch.get_num_threads()
    threads = StepThreads("int8", CPU)

    def steps():
        seen = []
        for decode in (True, False, True):
            threads.for_step(decode)
            x = torch.randn(64, 64)
            seen.append((torch.get_num_threads(), torch.equal(x @ x, x @ x)))
        return seen

    assert _on_a_thread(steps) == [(1, True), (default, True), (1, True)]
    assert torch.get_num_threads() == default  # the calling thread never changed


@needs_threads
def test_float32_steps_keep_the_process_count():
    default = torch.get_num_threads()
    threads = StepThreads("none", CPU)

    def step():
        threads.for_step(True)
        return torch.get_num_threads()

    assert _on_a_thread(step) == default


@pytest.mark.skipif(_mkl_local_setter() is None, reason="this torch build does not reach MKL")
@needs_threads
def test_int8_decode_holds_mkl_to_one_thread_after_torch_set_num_threads():
    """torch.set_num_threads sets MKL's global count, which then wins over the thread's OpenMP team
    size: the step must set MKL's thread-local count too (the attention's sgemms run on MKL)."""
    get = _libtorch_symbol("MKL_Get_Max_Threads", ctypes.c_int)
    get.argtypes = []
    default = torch.get_num_threads()
    torch.set_num_threads(default)  # as a benchmark's --threads or a user's script does
    threads = StepThreads("int8", CPU)

    def steps():
        seen = []
        for decode in (True, False):
            threads.for_step(decode)
            seen.append(get())
        return seen

    assert _on_a_thread(steps) == [1, default]
    assert get() == default  # the calling thread never changed
