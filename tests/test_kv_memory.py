"""The KV pool's host memory: mapped lazily (nothing touched at start-up), zeros until written, one map per
layer's K and V."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from radixlm.runtime.executor import host_memory
from radixlm.runtime.executor.kv_pool import KVPool


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


linux_only = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")


@linux_only
def test_a_large_buffer_is_zeros_and_costs_no_memory_until_written():
    shape = (4096, 8, 64)  # 8 MiB of float32
    nbytes = 4096 * 8 * 64 * 4
    before = _resident_bytes()
    x = host_memory.zeros(shape, torch.float32, "cpu")
    assert _resident_bytes() - before < nbytes // 4  # torch.zeros would have written all 8 MiB
    assert x.shape == shape and x.dtype == torch.float32 and x.is_contiguous()
    assert not bool(x.any())  # read before any write: the kernel's zero pages
    touched = _resident_bytes()
    x[:2048].fill_(1.5)  # half of it
    grown = _resident_bytes() - touched
    assert nbytes // 2 - (1 << 20) <= grown <= nbytes // 2 + (1 << 20)
    assert float(x.sum()) == 1.5 * nbytes // 8 and not bool(x[2048:].any())


@linux_only
def test_the_buffer_lives_as_long_as_a_view_of_it_and_is_freed_after():
    x = host_memory.zeros((2048, 4, 64), torch.float32, "cpu")  # 2 MiB
    x.fill_(2.0)
    view = x[10:20]
    del x
    gc.collect()
    assert float(view.sum()) == 2.0 * view.numel()  # still mapped
    before = _resident_bytes()
    del view
    gc.collect()
    assert before - _resident_bytes() >= (1 << 20)  # unmapped with its last tensor


@pytest.mark.parametrize("shape,dtype", [((4, 3), torch.float32), ((1 << 18, 2), torch.bfloat16),
                                         ((300, 5, 7), torch.int64)])
def test_zeros_matches_torch_zeros_in_every_size_and_dtype(shape, dtype):
    x = host_memory.zeros(shape, dtype, torch.device("cpu"))
    assert torch.equal(x, torch.zeros(shape, dtype=dtype)) and x.is_contiguous()
    x.view(-1)[-1] = 7  # writable to its last element
    assert int(x.view(-1)[-1]) == 7


def test_the_pool_reads_zeros_and_keeps_what_is_written_per_layer():
    pool = KVPool(num_slots=20000, num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                  device=torch.device("cpu"))
    assert all(not bool(t.any()) for t in pool.k + pool.v)
    slots = torch.tensor([0, 7, 19999, pool.dummy_slot])
    k, v = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1][slots], k) and torch.equal(pool.v[1][slots], v)
    assert not bool(pool.k[0].any()) and not bool(pool.v[2].any())  # layers do not share memory


def test_available_memory_is_the_kernels_capped_by_a_cgroup(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    8000000 kB\n")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(host_memory, "_MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "_CGROUP_FILES", ((str(limit), str(usage)),))
    assert host_memory.available_bytes() == 8_000_000 * 1024  # no cgroup files
    limit.write_text("max\n")
    usage.write_text("123\n")
    assert host_memory.available_bytes() == 8_000_000 * 1024  # a cgroup without a limit
    limit.write_text(f"{3 << 30}\n")
    usage.write_text(f"{1 << 30}\n")
    assert host_memory.available_bytes() == 2 << 30  # the container's limit less its use
    meminfo.write_text("garbage")
    assert host_memory.available_bytes() == 2 << 30
    limit.unlink()
    assert host_memory.available_bytes() is None


def test_a_cpu_pool_fits_the_memory_available_or_start_up_says_so(make_tiny_model, monkeypatch):
    """The pool is mapped lazily, so a pool larger than memory would only fail once the cache filled
    it: the default is cut to half of what is available, and an explicit size that cannot fit is a
    start-up error naming the flags."""
    from radixlm.runtime.engine_args import EngineArgs
    from radixlm.runtime.executor import model_runner
    from radixlm.runtime.executor.model_runner import ModelRunner

    folder = make_tiny_model()
    per_slot = KVPool.bytes_per_slot(2, 2, 16, torch.float32)  # the tiny model: 2 layers, 2 KV heads of 16
    monkeypatch.setattr(model_runner.host_memory, "available_bytes", lambda: 64 << 20)
    runner = ModelRunner(EngineArgs(model=str(folder), log_level="warning"))
    assert runner.kv_pool.num_slots == (32 << 20) // per_slot  # not DEFAULT_CPU_KV_GB
    with pytest.raises(ValueError, match="more than the 0.06 GiB of memory available; lower --max-total-tokens"):
        ModelRunner(EngineArgs(model=str(folder), max_total_tokens=(64 << 20) // per_slot + 1, log_level="warning"))
    with pytest.raises(ValueError, match="kv-memory-gb"):
        ModelRunner(EngineArgs(model=str(folder), kv_memory_gb=0.1, log_level="warning"))
    fits = ModelRunner(EngineArgs(model=str(folder), max_total_tokens=(60 << 20) // per_slot, log_level="warning"))
    assert fits.kv_pool.num_slots == (60 << 20) // per_slot


@linux_only
def test_memory_freed_on_another_thread_goes_back_to_the_kernel():
    """What a loader thread frees among blocks still alive stays in glibc's arena (the process keeps it
    resident) until `return_freed_memory` hands it back. Run in a child: the test process's own heap
    would blur the figure."""
    code = """
import sys, threading
from radixlm.runtime.executor import host_memory
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
kept = []
def work():
    blocks = [bytearray(64 * 1024) for _ in range(4000)]  # 250 MiB under glibc's mmap threshold
    kept.extend(blocks[::50])  # a few stay alive among them: the arena cannot shrink from its top
    blocks.clear()
t = threading.Thread(target=work); t.start(); t.join()
before = rss()
host_memory.return_freed_memory()
print(before - rss())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip()) > 150, out.stdout  # MiB returned
