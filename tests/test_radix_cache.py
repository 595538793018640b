"""The radix cache against a naive model (hypothesis state machine) plus targeted unit tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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

    def do_insert(self, seq: tuple[int, ...], slots: torch.Tensor) -> int:
        expected_prefix = len(self.expected_match(seq))
        prefix_len = self.cache.insert(seq, slots)
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
        prefix_len = self.do_insert(seq, slots)
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
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixCacheMachine = RadixCacheMachine.TestCase


def make_cache(disable: bool = False) -> tuple[RadixCache, FakeAllocator]:
    alloc = FakeAllocator()
    return RadixCache(alloc, disable=disable), alloc


def put(cache: RadixCache, alloc: FakeAllocator, tokens: list[int]) -> torch.Tensor:
    """Insert ``tokens`` with fresh slots, freeing the caller's duplicates; return the fresh slots."""
    slots = alloc.alloc(len(tokens))
    prefix_len = cache.insert(tokens, slots)
    if prefix_len:
        alloc.free(slots[:prefix_len])
    return slots


def test_split_on_partial_match_keeps_both_halves():
    cache, alloc = make_cache()
    slots = put(cache, alloc, [1, 2, 3, 4, 5])
    assert cache.num_nodes == 1
    res = cache.match_prefix([1, 2, 3, 9])
    assert res.slots.tolist() == slots[:3].tolist()
    assert tuple(res.last_node.key) == (1, 2, 3)  # the match ends exactly at last_node
    assert cache.num_nodes == 2
    (tail,) = res.last_node.children.values()
    assert tuple(tail.key) == (4, 5) and tail.parent is res.last_node
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == slots.tolist()
    assert cache.match_prefix([1, 2]).slots.tolist() == slots[:2].tolist()
    cache.check_integrity()


def test_insert_returns_prefix_len_and_takes_ownership_of_the_rest():
    cache, alloc = make_cache()
    a = put(cache, alloc, [1, 2, 3])
    b = alloc.alloc(5)
    assert cache.insert([1, 2, 7, 8, 9], b) == 2
    alloc.free(b[:2])
    assert cache.match_prefix([1, 2, 7, 8, 9]).slots.tolist() == a[:2].tolist() + b[2:].tolist()
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == a.tolist()
    assert cache.insert([1, 2], a[:2]) == 2  # already cached, nothing taken
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    assert alloc.live == set(a.tolist()) | set(b[2:].tolist())
    assert cache.total_size == 6
    cache.check_integrity()


def test_insert_rejects_mismatched_slots():
    cache, _ = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([0, 1]))


def test_evict_is_lru_over_leaves():
    cache, alloc = make_cache()
    a = put(cache, alloc, [1, 1])
    b = put(cache, alloc, [2, 2])
    c = put(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # a is now the most recent, b the oldest
    assert cache.evict(1) == 2
    assert set(b.tolist()).isdisjoint(alloc.live)
    assert cache.evict(2) == 2
    assert set(c.tolist()).isdisjoint(alloc.live)
    assert alloc.live == set(a.tolist())
    cache.check_integrity()


def test_evict_takes_parent_once_its_children_are_gone():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 4])
    put(cache, alloc, [5])
    cache.match_prefix([5])
    assert cache.num_nodes == 4
    assert cache.evict(3) == 4  # leaves [3] and [4] (2 < 3), then their parent [1, 2]
    assert cache.match_prefix([1], record_stats=False).slots.numel() == 0
    assert cache.total_size == 1 and cache.num_nodes == 1
    cache.check_integrity()


def test_locked_path_is_never_evicted():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 9])
    put(cache, alloc, [7, 7])
    node = cache.match_prefix([1, 2, 3]).last_node  # splits [3, 4] into [3] + [4]
    cache.inc_lock(node)
    assert cache.protected_size == 3 and cache.evictable_size == 4
    assert cache.evict(100) == 4  # [4], [9], [7, 7]; the locked [1, 2] + [3] stay
    assert cache.protected_size == 3 and cache.evictable_size == 0
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 3
    cache.dec_lock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 3
    assert cache.evict(100) == 3
    assert alloc.live == set()
    cache.check_integrity()


def test_nested_locks_and_dec_lock_below_zero():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2, 3])
    upper = cache.match_prefix([1]).last_node
    lower = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock(lower)
    cache.inc_lock(upper)
    assert (upper.lock_ref, lower.lock_ref) == (2, 1)
    cache.dec_lock(upper)
    cache.dec_lock(lower)
    assert cache.evictable_size == 3
    with pytest.raises(RuntimeError):
        cache.dec_lock(lower)
    assert lower.lock_ref == 0 and upper.lock_ref == 0
    cache.inc_lock(cache.root)  # the root is never counted: locking it is a no-op
    cache.dec_lock(cache.root)
    cache.check_integrity()


def test_inc_lock_on_an_evicted_node_raises():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    cache.evict(2)
    with pytest.raises(RuntimeError):
        cache.inc_lock(node)


def test_reset_frees_everything_and_refuses_while_locked():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 4])
    node = cache.match_prefix([1, 4]).last_node
    cache.inc_lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.check_integrity()
    cache.dec_lock(node)
    cache.reset()
    assert alloc.live == set()
    assert cache.total_size == 0 and cache.num_nodes == 0
    assert cache.match_prefix([1, 2, 3]).last_node is cache.root
    cache.check_integrity()


def test_disabled_cache_frees_on_insert_and_never_hits():
    cache, alloc = make_cache(disable=True)
    slots = alloc.alloc(3)
    assert cache.insert([1, 2, 3], slots) == 0
    assert alloc.live == set()
    res = cache.match_prefix([1, 2, 3])
    assert res.slots.numel() == 0 and res.last_node is cache.root
    assert cache.evict(10) == 0
    assert (cache.evictable_size, cache.protected_size, cache.total_size) == (0, 0, 0)
    assert cache.stats()["query_tokens"] == 3 and cache.stats()["hit_tokens"] == 0
    cache.inc_lock(res.last_node)
    cache.dec_lock(res.last_node)
    cache.reset()
    cache.check_integrity()


def test_stats_and_hit_rate():
    cache, alloc = make_cache()
    assert cache.stats()["hit_rate"] == 0.0
    put(cache, alloc, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4])  # 4 of 4
    cache.match_prefix([1, 2, 5, 6])  # 2 of 4
    cache.match_prefix([1, 2, 5, 6], record_stats=False)
    stats = cache.stats()
    assert stats == {
        "hit_tokens": 6,
        "query_tokens": 8,
        "hit_rate": 0.75,
        "evictable_size": 4,
        "protected_size": 0,
        "num_nodes": 2,
    }
    cache.reset_stats()
    assert (cache.hit_tokens, cache.query_tokens) == (0, 0)


def test_tensor_tokens_and_int32_slots_are_accepted():
    cache, alloc = make_cache()
    slots = alloc.alloc(3).to(torch.int32)
    assert cache.insert(torch.tensor([4, 5, 6]), slots) == 0
    res = cache.match_prefix(torch.tensor([4, 5]))
    assert res.slots.dtype == torch.int64 and res.slots.tolist() == slots[:2].tolist()
    cache.check_integrity()


def test_check_integrity_catches_corruption():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 5])
    cache.check_integrity()
    node = cache.match_prefix([1, 5]).last_node
    node.value = cache.root.children[1].value[:1].clone()  # a slot owned twice
    with pytest.raises(AssertionError, match="owned twice"):
        cache.check_integrity()
    cache2, alloc2 = make_cache()
    put(cache2, alloc2, [1, 2])
    cache2.root.children[1].lock_ref = 1  # lock without moving the size into protected
    with pytest.raises(AssertionError, match="evictable_size"):
        cache2.check_integrity()


def test_insert_refreshes_lru_too():
    cache, alloc = make_cache()
    a = put(cache, alloc, [1, 1])
    put(cache, alloc, [2, 2])
    put(cache, alloc, [1, 1])  # re-inserting a cached sequence counts as a use
    assert cache.evict(1) == 2
    assert alloc.live == set(a.tolist())


# --------------------------------------------------------------------------- for people: hits, evictions, reports
def test_hits_count_requests_through_each_node_and_survive_splits():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2, 3, 4])
    for _ in range(3):
        cache.match_prefix([1, 2, 3, 4, 9])  # through the whole edge
    res = cache.match_prefix([1, 2, 7])  # splits it: the upper half was passed by all four
    assert res.last_node.hits == 4
    (tail,) = res.last_node.children.values()
    assert tail.hits == 3 and tail.last_used <= res.last_node.last_used
    cache.match_prefix([1, 2, 3, 4], record_stats=False)  # a peek is not a hit
    assert tail.hits == 3
    assert cache.windows.rates()["1m"] == {"hit_tokens": 14, "query_tokens": 18, "hit_rate": 14 / 18}
    cache.check_integrity()


def test_evictions_are_logged_with_their_reason():
    cache, alloc = make_cache()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [5, 6])
    assert cache.evict(1, reason="admission") == 3  # the least recently used leaf, whole
    cache.reset()
    log = cache.evictions.to_dict()
    assert log["tokens"] == 5
    assert set(log["by_reason"]) == {"admission", "flush"}
    assert log["by_reason"]["flush"]["nodes"] == 1
    assert [r["reason"] for r in log["recent"]] == ["flush", "admission"]  # newest first


def test_summary_ranks_prefixes_by_tokens_saved_and_ids_stay_ids():
    cache, alloc = make_cache()
    system = list(range(100, 140))
    for user in range(5):
        put(cache, alloc, system + [user, user])
        cache.match_prefix(system + [user, user, 9])
    cache.match_prefix(system + [77])
    out = report.summary(cache, top=3)
    best = out["top_prefixes"][0]
    assert best["prefix_tokens"] == len(system) and best["hits"] == 6
    assert best["tokens_saved"] == 6 * len(system)
    assert best["head_ids"] == system[:report.HEAD_TOKENS]
    assert len(out["top_prefixes"]) == 3 and all(p["tokens_saved"] > 0 for p in out["top_prefixes"])
    assert out["cached_tokens"] == cache.total_size and out["nodes"] == 6 and not out["truncated"]


def test_reports_stay_bounded_on_a_tree_of_100k_nodes():
    """Time and bytes of GET /cache and /cache/tree do not grow with the tree past MAX_VISIT nodes."""
    import json
    import time

    class Null:
        def free(self, slots):
            pass

    cache = RadixCache(Null())
    n = 0
    for i in range(34_000):  # a leaf and two splits of it per insert: over 100k nodes in all
        seq = (i % 7, (i // 7) % 50, -i, 1, 2, 3)
        cache.insert(seq, torch.arange(n, n + 6))
        n += 6
        cache.match_prefix(seq[:4] + (-1,), record_stats=bool(i % 2))
        cache.match_prefix(seq[:5] + (-1,), record_stats=bool(i % 3))
    assert cache.num_nodes > 100_000
    start = time.perf_counter()
    summary = report.summary(cache, top=100)
    tree = report.tree(cache, depth=64, max_nodes=5000)
    seconds = time.perf_counter() - start
    assert summary["truncated"] and tree["truncated"]
    assert len(json.dumps(summary)) < 100_000 and len(json.dumps(tree)) < 2_500_000
    assert len(tree["nodes"]) == 5000
    assert seconds < 3.0, f"reports took {seconds:.2f}s on a 100k-node tree"  # ~0.2 s here; a loaded CI box
