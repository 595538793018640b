"""The KV pool's host memory: mapped lazily (nothing touched at start-up), zeros until written, one map per
layer's K and V."""

from __future__ import annotations

import gc
import os

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
