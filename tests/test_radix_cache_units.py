"""The radix cache's targeted unit tests: splits, insert, LRU eviction, locks, reset, the disabled cache,
stats and integrity checks, and the reports for people (hits, evictions, summaries)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from test_radix_cache import FakeAllocator

from radixlm.radix_cache import RadixCache, report


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


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=6), st.data())
def test_a_requests_prefix_and_span_are_slices_of_its_tokens(prompt, output, data):
    """Req.prefix / span (what admission and the cache read) equal slices of prompt + output, also
    after the prompt list is replaced (token healing backs off its last token) or the output grows."""
    from radixlm.runtime.request.params import SamplingParams
    from radixlm.runtime.request.req import Req

    req = Req("r", list(prompt), SamplingParams(), output_ids=list(output))
    for _ in range(3):
        seq = req.input_ids + req.output_ids
        end = data.draw(st.integers(0, len(seq)))
        start = data.draw(st.integers(0, end))
        assert req.prefix(end) == tuple(seq[:end]) and req.span(start, end) == seq[start:end]
        if data.draw(st.booleans()) and req.input_ids:
            req.input_ids = req.input_ids[:-1]
        else:
            req.output_ids.append(data.draw(st.integers(0, 9)))
