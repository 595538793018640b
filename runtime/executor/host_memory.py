"""Host buffers: large zeroed ones that cost nothing until they are written (anonymous memory maps),
and small int64 tensors made from Python lists at a fraction of torch.tensor's cost (`int64s`).

`torch.zeros` writes every byte of a buffer at once. For the CPU KV pool (2 GiB by default) that is
half a million page faults at start-up, a large share of a small model's start (benchmarks/README.md,
"Server start-up"), and the process's first long prefill runs slower than its later ones. An anonymous
map is zero-filled by the kernel page by page as it is first written, so start-up pays nothing and
resident memory grows with the slots written so far. Reads of a never-written page see zeros, the
same values `torch.zeros` gives.

Loading a model converts and packs its weights on several threads, and glibc keeps what they free in
per-thread arenas (64 MiB each) instead of handing it back: without `return_freed_memory` after the
load, a CPU server's resident memory was 2.6x what the model and its touched pages need.
"""

from __future__ import annotations

import array
import ctypes
import math
import mmap
from collections.abc import Sequence
from pathlib import Path

import torch

MIN_MAPPED_BYTES = 1 << 20  # smaller buffers are not worth a map of their own


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape, dtype) on `device`, contiguous; on the CPU, from MIN_MAPPED_BYTES up, backed by an
    anonymous map of its own (freed with the tensor) and not touched here."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MIN_MAPPED_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):  # (Windows)
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor keeps the map alive through the buffer protocol; MAP_PRIVATE | MAP_ANONYMOUS is zero-filled
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


def return_freed_memory() -> None:
    """Hands the pages the heap holds free back to the kernel (glibc's `malloc_trim`, which trims every
    thread's arena); nothing where the C library has no such call (musl, macOS, Windows)."""
    try:
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library the process runs on
    except (OSError, TypeError):  # (Windows has no process-wide handle)
        return
    if trim is not None:
        trim(0)


def int64s(values: Sequence[int]) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.int64) on the CPU, for the scheduler's per-step lists.
    torch.tensor checks and converts each Python int on its own; an array("q") converts them in one
    C loop, about three times faster on a step's few hundred ints, and the tensor takes its buffer.
    The tensor keeps the array alive; an int outside int64 raises OverflowError."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def as_int64(t: torch.Tensor) -> torch.Tensor:
    """`t` as int64, without the dispatch a no-op `.to` still costs when it already is."""
    return t if t.dtype == torch.int64 else t.to(torch.int64)


_MEMINFO = Path("/proc/meminfo")
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def available_bytes() -> int | None:
    """Memory this process could still fill: the kernel's MemAvailable, capped by what a memory cgroup
    (a container's limit) has left; None where neither can be read. A lazily mapped pool is checked
    against it at start-up, since a pool larger than this would be found out only once it filled."""
    found = []
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as a huge number
                found.append(max(int(limit) - int(Path(usage_file).read_text()), 0))
        except (OSError, ValueError):
            continue
    return min(found) if found else None
