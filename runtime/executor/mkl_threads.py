"""MKL's threads on the thread that runs the forward: one during int8 decode steps.

torch's CPU ops run on its OpenMP pool, and MKL (linked into libtorch for sgemm) keeps threads of
its own. In an int8 decode step (`--quantization int8`: the matmuls are fbgemm's, on torch's pool)
the small float products left (attention's per-head blocks, the invariant backend's tiles) each
wake MKL's second thread, which then competes for the same two cores with the next op's OpenMP
threads. Measured on this project's 2-core CPU, int8 with torch attention: one client decoded 26
tok/s with MKL threaded and 44 tok/s with MKL on one thread, 8 clients 130 and 220 tok/s. Not in
float32: there the model's matmuls are oneDNN's, which use MKL's threads (the `unique` workload of
benchmarks/offline.py lost 24% with one). Prefill keeps MKL's threads either way: the invariant
backend's large score and value products use them.

`MKL_Set_Num_Threads_Local` is thread-local (0 restores the process-wide setting), so the host
thread is untouched. Builds without MKL (aarch64, some wheels) lack the symbol: then nothing is
done.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@functools.cache
def _setter() -> Callable[[int], int] | None:
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        fn = lib.MKL_Set_Num_Threads_Local  # the C spelling (lowercase is Fortran's: an int pointer)
    except (OSError, AttributeError) as e:
        logger.debug("MKL's thread count stays as it is: %s", e)
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def for_step(decode: bool) -> None:
    """Call on the forward's thread before each CPU step."""
    fn = _setter()
    if fn is not None:
        fn(1 if decode else 0)
