"""The KV slot allocator against a plain FIFO model: the same ids in the same order for any sequence of
allocations and frees (frees are queued and merged only when an allocation needs them), exact counts,
the free mask, out-of-slots and double-free errors, and a freed tensor the caller reuses afterwards."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.executor.kv_pool import OutOfSlotsError, SlotAllocator

# one operation: ("alloc", n) or ("free", which of the held runs, how many of its ids from the front)
ops = st.lists(st.one_of(st.tuples(st.just("alloc"), st.integers(0, 12)),
                         st.tuples(st.just("free"), st.integers(0, 50), st.integers(1, 12))), max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(num_slots=st.integers(1, 40), program=ops, debug=st.booleans())
def test_allocations_match_a_fifo_free_list(num_slots, program, debug):
    alloc = SlotAllocator(num_slots, debug=debug)
    model = deque(range(num_slots))
    held: list[list[int]] = []
    for op in program:
        if op[0] == "alloc":
            n = op[1]
            if n > len(model):
                with pytest.raises(OutOfSlotsError):
                    alloc.alloc(n)
                continue
            got = alloc.alloc(n).tolist()
            assert got == [model.popleft() for _ in range(n)]
            if got:
                held.append(got)
        elif held:
            run = held[op[1] % len(held)]
            k = min(op[2], len(run))
            freed, run[:] = run[:k], run[k:]
            held = [r for r in held if r]
            alloc.free(torch.tensor(freed))
            model.extend(freed)
        assert alloc.num_free == len(model)
        assert alloc.free_mask().nonzero().flatten().tolist() == sorted(model)
    assert alloc.num_free + sum(map(len, held)) == num_slots


def test_a_freed_tensor_reused_by_its_caller_does_not_change_the_free_list():
    alloc = SlotAllocator(8)
    slots = alloc.alloc(8)
    buffer = slots[:3].clone()
    alloc.free(buffer)
    buffer.fill_(7)  # e.g. a step's slot buffer written again
    assert alloc.alloc(3).tolist() == [0, 1, 2]


def test_debug_mode_refuses_double_frees_queued_or_merged():
    alloc = SlotAllocator(6, debug=True)
    slots = alloc.alloc(6)
    alloc.free(slots[:2])
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(slots[1:3])  # slot 1 is queued, not yet merged
    alloc.alloc(1)  # merges the queue: slot 0 out again, slot 1 free in the list
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(slots[1:2])
    alloc.reset()
    assert alloc.num_free == 6 and alloc.alloc(6).tolist() == list(range(6))
