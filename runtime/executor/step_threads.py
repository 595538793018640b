"""How many OpenMP threads the forward's thread runs a CPU step on: one for int8 decode steps.

torch's CPU ops split their work over an OpenMP team. In an int8 decode step (`--quantization int8`)
the work is ~120 small fbgemm matmuls and ~2,000 tiny ops; measured on this project's 2-vCPU VM,
torch attention, the same decode batch replayed (`benchmarks/README.md`, "Threads in int8 decode"):

| OpenMP threads | one-client step | 8 clients | 32 clients |
|--:|--:|--:|--:|
| 1 | 21 ms (42 tok/s) | 205 tok/s | 380-405 tok/s |
| 2 | 36 ms (23-27 tok/s) | 110 tok/s | 250-315 tok/s |

Each matmul alone runs 1.6-2x faster on two threads, but in the model the second thread sleeps
through the small ops between them and every parallel region waits for it to wake (the profile puts
the loss in the matmuls, 9.6 -> 23.6 ms, and attention, 0.5 -> 4.8 ms); spinning instead
(OMP_WAIT_POLICY=ACTIVE) gets back only part of it (31 tok/s). float32 decode is the other way
round (8 clients: 95 tok/s on one thread, 112 on two; oneDNN's larger matmuls keep both busy), and so
is no clear rule for prefill, so both keep the process's count.

The count is set with `omp_set_num_threads`, which changes only the calling thread's team size, so
the host thread (and a caller's own torch work) is untouched, and with MKL's thread-local count
(`MKL_Set_Num_Threads_Local`, put back to the process-wide count after the step): once anything in
the process has called `torch.set_num_threads` (a benchmark's `--threads`, a user's script), MKL
follows its own global count instead of the thread's team size, and the attention's sgemms ran on
two threads again (`benchmarks/decode_split.py --threads 2`: 33.7 ms a step instead of 21.1). Builds
without an OpenMP runtime or MKL reachable from libtorch: that part is skipped.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

INT8_DECODE_THREADS = 1


def _libtorch_symbol(name: str, restype) -> Callable | None:
    try:  # dlsym on libtorch's handle also searches what it links (the OpenMP runtime, MKL)
        fn = getattr(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")), name)
    except (OSError, AttributeError) as e:
        logger.debug("%s is not reachable: %s", name, e)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], restype
    return fn


@functools.cache
def _omp_setter() -> Callable[[int], None] | None:
    return _libtorch_symbol("omp_set_num_threads", None)


@functools.cache
def _mkl_local_setter() -> Callable[[int], int] | None:
    """MKL's thread-local count (0: back to the process-wide one). Needed beside OpenMP's: once
    `torch.set_num_threads` has run in the process, MKL's own global count wins over the thread's
    OpenMP team size, and the attention's sgemms went back to two threads (int8 step 21 -> 34 ms)."""
    return _libtorch_symbol("MKL_Set_Num_Threads_Local", ctypes.c_int)  # the C spelling


class StepThreads:
    """Sets the team size of the thread that runs each step (call `for_step` on that thread)."""

    def __init__(self, quantization: str, device: torch.device):
        self.default = torch.get_num_threads()  # the process's count, read where the runner is built
        self.decode = INT8_DECODE_THREADS if device.type == "cpu" and quantization != "none" else self.default
        self._set = _omp_setter() if self.decode != self.default else None
        self._set_mkl = _mkl_local_setter() if self._set is not None else None
        self._seen = threading.local()

    def for_step(self, decode: bool) -> None:
        if self._set is None:
            return
        if not getattr(self._seen, "init", False):
            # torch sets a thread's team size from the process's count on its first parallel op
            # there; let it do so now, or it would undo the first step's setting
            torch.get_num_threads()
            self._seen.init = True
        self._set(self.decode if decode else self.default)  # an ICV store: cheap to repeat every step
        if self._set_mkl is not None:
            self._set_mkl(self.decode if decode else 0)
