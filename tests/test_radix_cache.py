"""The radix cache against a naive model (hypothesis state machine); unit tests: test_radix_cache_units.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from hypothesis_budget import examples

from radixlm.radix_cache import MatchResult, RadixCache, TreeNode, report


class FakeAllocator:
    """Hands out slot ids from a free list and catches double frees and frees of unknown slots."""

    def __init__(self, size: int = 4096) -> None:
        self.free_list = list(range(size - 1, -1, -1))
        self.live: set[int] = set()
        self.last_freed: list[int] = []

    def alloc(self, n: int) -> torch.Tensor:
        out = [self.free_list.pop() for _ in range(n)]
        self.live.update(out)
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        ids = slots.tolist()
        assert len(set(ids)) == len(ids), f"slots freed twice in one call: {ids}"
        for s in ids:
            assert s in self.live, f"double free (or free of a never-allocated slot) {s}"
            self.live.remove(s)
            self.free_list.append(s)
        self.last_freed.extend(ids)


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Read-only walk: every cached prefix -> the slot of its last token."""
    out: dict[tuple[int, ...], int] = {}
    stack = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            p = prefix
            for tok, slot in zip(child.key, child.value.tolist(), strict=True):
                p = p + (tok,)
                out[p] = slot
            stack.append((p, child))
    return out


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(tuple(node.key))
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


seqs = st.lists(st.integers(0, 3), max_size=12)


class RadixCacheMachine(RuleBasedStateMachine):
    """Model: ``cached`` maps every cached prefix to the slot of its last token (prefix-closed).

    Requests mimic the scheduler: start = match + lock + allocate the uncached tail; finish =
    insert + free own duplicates + unlock. Slots a running request holds outside the tree are
    tracked in ``pending`` so the allocator's live set must equal tree slots + request slots.
    """

    def __init__(self) -> None:
        super().__init__()
        self.alloc = FakeAllocator()
        self.cache = RadixCache(self.alloc)
        self.cached: dict[tuple[int, ...], int] = {}
        self.pending: list[tuple[tuple[int, ...], torch.Tensor, int, TreeNode]] = []
        self.hits = 0
        self.queries = 0
        self.evicted = 0  # tokens, by evict() and reset()

    def expected_match(self, seq: tuple[int, ...]) -> list[int]:
        out = []
        for i in range(1, len(seq) + 1):
            if seq[:i] not in self.cached:
                break
            out.append(self.cached[seq[:i]])
        return out

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        out = set()
        for _, _, _, node in self.pending:
            path = path_tokens(node)
            out.update(path[:i] for i in range(1, len(path) + 1))
        return out

    def do_insert(self, seq: tuple[int, ...], slots: torch.Tensor, node: TreeNode | None = None, start: int = 0) -> int:
        expected_prefix = len(self.expected_match(seq))
        prefix_len = self.cache.insert(seq, slots, node, start)
        assert prefix_len == expected_prefix
        for i in range(prefix_len, len(seq)):
            self.cached[seq[: i + 1]] = int(slots[i])
        return prefix_len

    @rule(seq=seqs)
    def insert_fresh(self, seq):
        seq = tuple(seq)
        slots = self.alloc.alloc(len(seq))
        prefix_len = self.do_insert(seq, slots)
        if prefix_len:
            self.alloc.free(slots[:prefix_len])  # all duplicates: none of them is the tree's

    @rule(seq=seqs, record=st.booleans())
    def match(self, seq, record):
        seq = tuple(seq)
        expected = self.expected_match(seq)
        res = self.cache.match_prefix(seq, record_stats=record)
        assert isinstance(res, MatchResult)
        assert res.slots.dtype == torch.int64 and res.slots.dim() == 1
        assert res.slots.tolist() == expected
        assert path_tokens(res.last_node) == seq[: len(expected)]
        if record:
            self.queries += len(seq)
            self.hits += len(expected)

    @rule(seq=seqs)
    def start_request(self, seq):
        seq = tuple(seq)
        res = self.cache.match_prefix(seq)
        self.queries += len(seq)
        self.hits += len(res.slots)
        assert res.slots.tolist() == self.expected_match(seq)
        self.cache.inc_lock(res.last_node)
        tail = self.alloc.alloc(len(seq) - len(res.slots))
        self.pending.append((seq, torch.cat([res.slots, tail]), len(res.slots), res.last_node))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def finish_request(self, data):
        i = data.draw(st.integers(0, len(self.pending) - 1))
        seq, slots, matched, node = self.pending.pop(i)
        assert path_tokens(node) == seq[:matched], "a locked node moved"
        # from the root, or from the request's locked node as the scheduler's release does: the same tree
        prefix_len = self.do_insert(seq, slots, *((node, matched) if data.draw(st.booleans()) else ()))
        assert prefix_len >= matched, "a locked prefix was lost"
        if prefix_len > matched:  # someone else cached these meanwhile: ours are duplicates
            self.alloc.free(slots[matched:prefix_len])
        self.cache.dec_lock(node)

    @rule(amount=st.integers(0, 24))
    def evict(self, amount):
        before = dict(self.cached)
        evictable = self.cache.evictable_size
        protected = self.cache.protected_size
        locked = self.locked_prefixes()
        nodes_before = list(self.cache.iter_nodes())
        self.alloc.last_freed = []
        freed = self.cache.evict(amount)
        self.evicted += freed
        freed_slots = set(self.alloc.last_freed)
        assert freed == len(self.alloc.last_freed) == len(freed_slots)
        assert freed >= min(amount, evictable)
        if amount >= evictable:
            assert self.cache.evictable_size == 0
        assert self.cache.protected_size == protected
        assert self.cache.evictable_size == evictable - freed
        removed = {p for p, s in before.items() if s in freed_slots}
        assert len(removed) == freed, "evict freed slots the tree did not own"
        assert not removed & locked, "evict removed a locked prefix"
        for p in before:  # only whole subtrees go: every extension of an evicted prefix goes too
            if p[:-1] in removed:
                assert p in removed, f"{p} survived its evicted parent"
        for p in removed:
            del self.cached[p]
        # LRU: nothing evicted was used more recently than any unlocked leaf that remains.
        remaining = set(map(id, self.cache.iter_nodes()))
        evicted_times = [n.last_access for n in nodes_before if id(n) not in remaining]
        leaf_times = [n.last_access for n in self.cache.iter_nodes() if not n.children and not n.lock_ref]
        if evicted_times and leaf_times:
            assert max(evicted_times) <= min(leaf_times)

    @rule()
    def reset(self):
        if any(matched for _, _, matched, _ in self.pending):  # a lock on the root is no lock
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return
        self.evicted += len(self.cached)
        self.cache.reset()
        self.cached.clear()
        self.consistent()

    @rule(budget=st.integers(1, 30))
    def snapshot_plan(self, budget):
        """What a KV snapshot keeps: within the budget, parents first, a connected part of the tree
        from the root, cached prefixes only; a node kept in part is where the walk ended."""
        kept = report.hottest(self.cache, budget)
        assert sum(k.take for k in kept) <= budget
        paths: list[tuple[int, ...]] = []
        for i, k in enumerate(kept):
            assert -1 <= k.parent < i
            assert k.node.parent is (self.cache.root if k.parent < 0 else kept[k.parent].node)
            assert k.parent < 0 or kept[k.parent].take == len(kept[k.parent].node.key), "child of a part-kept node"
            assert 1 <= k.take <= len(k.node.key)
            paths.append((paths[k.parent] if k.parent >= 0 else ()) + tuple(k.node.key[: k.take]))
            assert paths[-1] in self.cached
        if self.cached and sum(k.take for k in kept) < budget:
            assert sum(k.take for k in kept) == len(self.cached), "budget left but nodes left out"

    @rule(depth=st.integers(1, 6), min_tokens=st.integers(0, 6), max_nodes=st.integers(1, 20))
    def tree_report(self, depth, min_tokens, max_nodes):
        out = report.tree(self.cache, depth=depth, min_tokens=min_tokens, max_nodes=max_nodes)
        shown = {n["id"]: n for n in out["nodes"]}
        assert len(shown) <= max_nodes
        for n in out["nodes"]:
            assert n["depth"] <= depth and n["subtree_tokens"] >= min_tokens
            assert n["parent"] == out["root"] or n["parent"] in shown
            below = sum(c["subtree_tokens"] for c in out["nodes"] if c["parent"] == n["id"])
            assert n["subtree_tokens"] == n["edge_tokens"] + below + n["hidden_tokens"]
        top = sum(n["subtree_tokens"] for n in out["nodes"] if n["parent"] == out["root"])
        assert top + out["root_hidden_tokens"] == self.cache.total_size

    @invariant()
    def consistent(self):
        self.cache.check_integrity()
        assert tree_contents(self.cache) == self.cached
        request_slots = set()
        for _, slots, matched, _ in self.pending:
            request_slots.update(slots[matched:].tolist())
        tree_slots = set(self.cached.values())
        assert not tree_slots & request_slots
        assert self.alloc.live == tree_slots | request_slots, "slot leak or slot owned twice"
        locked = self.locked_prefixes()
        assert self.cache.protected_size == len(locked)
        assert self.cache.evictable_size == len(self.cached) - len(locked)
        assert self.cache.total_size == len(self.cached)
        assert self.cache.hit_tokens == self.hits and self.cache.query_tokens == self.queries
        assert self.cache.evictions.to_dict()["tokens"] == self.evicted


RadixCacheMachine.TestCase.settings = settings(
    max_examples=examples(200), stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixCacheMachine = RadixCacheMachine.TestCase
