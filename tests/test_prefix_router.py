"""The scale-out router without Ray: the per-replica prefix tree against a naive model (hypothesis),
routing policy decisions, routing keys of the three generation routes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.server.scaleout.prefix_tree import PrefixTree
from radixlm.server.scaleout.router import PrefixRouter, RoundRobinRouter, RouterConfig, make_router, routing_key

# small alphabet: many shared prefixes and edge splits
keys = st.text(alphabet="abc", min_size=0, max_size=12)


def lcp(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prefixes(strings) -> set[str]:
    return {s[:i] for s in strings for i in range(1, len(s) + 1)}


@given(st.lists(keys, max_size=30), st.lists(keys, max_size=10))
@settings(max_examples=examples(300), deadline=None)
def test_tree_without_eviction_matches_naive_model(inserted, queries):
    tree = PrefixTree(max_chars=10_000)
    for k in inserted:
        tree.insert(k)
    for q in queries + inserted:
        assert tree.match(q) == max((lcp(q, k) for k in inserted), default=0)
    assert tree.size == len(prefixes(inserted))  # each distinct prefix character stored once
    assert prefixes(tree.keys()) == prefixes(inserted)


@given(st.lists(st.tuples(st.sampled_from(["insert", "match"]), keys), max_size=60),
       st.integers(min_value=1, max_value=20))
@settings(max_examples=examples(300), deadline=None)
def test_tree_with_budget_is_bounded_and_evicts_least_recently_used(ops, budget):
    tree = PrefixTree(max_chars=budget)
    inserted: list[str] = []
    for op, k in ops:
        if op == "insert":
            tree.insert(k)
            inserted.append(k)
        else:
            assert tree.match(k) <= max((lcp(k, s) for s in inserted), default=0)  # never claims more than sent
        assert tree.size <= budget
        assert tree.size == len(prefixes(tree.keys()))  # size accounting stays exact
        assert prefixes(tree.keys()) <= prefixes(inserted)  # holds nothing that was not sent
        # LRU: the most recently inserted strings that fit the budget together are all still there
        recent: list[str] = []
        for s in reversed([k[:budget] for k in inserted]):
            if len(prefixes(recent + [s])) > budget:
                break
            recent.append(s)
        for s in recent:
            assert tree.match(s) == len(s)


def test_tree_rejects_a_bad_budget_and_clears():
    with pytest.raises(ValueError, match="max_chars"):
        PrefixTree(0)
    tree = PrefixTree(100)
    tree.insert("hello world")
    tree.clear()
    assert tree.size == 0 and tree.match("hello") == 0


SYSTEM_A = "You are the assistant of Acme. " * 20
SYSTEM_B = "Answer as the support desk of Globex. " * 20


def test_shared_prefix_sticks_and_new_prefixes_spread():
    router = PrefixRouter(2)
    up = [True, True]
    first_a = router.choose(SYSTEM_A + "q1", [0, 0], up)
    first_b = router.choose(SYSTEM_B + "q1", [1 if first_a.replica == 0 else 0, 1 if first_a.replica == 1 else 0], up)
    assert first_a.reason == first_b.reason == "new"
    assert first_a.replica != first_b.replica  # a new prefix goes to the less loaded replica
    for q in ("q2", "q3", "another question"):
        a = router.choose(SYSTEM_A + q, [0, 0], up)
        b = router.choose(SYSTEM_B + q, [0, 0], up)
        assert (a.replica, a.reason) == (first_a.replica, "prefix") and a.matched_chars >= len(SYSTEM_A)
        assert (b.replica, b.reason) == (first_b.replica, "prefix")


def test_load_imbalance_past_the_threshold_falls_back_to_least_loaded():
    router = PrefixRouter(2, RouterConfig(imbalance_abs=4, imbalance_rel=2.0))
    home = router.choose(SYSTEM_A + "q", [0, 0], [True, True]).replica
    other = 1 - home
    loads = [0, 0]
    loads[home], loads[other] = 5, 1  # 4 more than the other: not past imbalance_abs
    assert router.choose(SYSTEM_A + "q2", loads, [True, True]).replica == home
    loads[home], loads[other] = 16, 10  # 6 more but only 1.6x: affinity holds
    assert router.choose(SYSTEM_A + "q4", loads, [True, True]).replica == home
    loads[home], loads[other] = 6, 1  # 5 more and 6x: past both thresholds
    d = router.choose(SYSTEM_A + "q3", loads, [True, True])
    assert (d.replica, d.reason) == (other, "balance")
    # now both replicas hold the prefix: the less loaded one wins the tie
    loads[home], loads[other] = 3, 2
    assert router.choose(SYSTEM_A + "q", loads, [True, True]).replica == other


def test_short_shared_prefix_does_not_count_and_down_replicas_are_skipped():
    router = PrefixRouter(3, RouterConfig(min_match_fraction=0.5))
    r0 = router.choose("common header: " + "x" * 100, [0, 0, 0], [True] * 3).replica
    d = router.choose("common header: " + "y" * 100, [1 if i == r0 else 0 for i in range(3)], [True] * 3)
    assert d.reason == "new" and d.replica != r0
    up = [True] * 3
    up[r0] = False
    d = router.choose("common header: " + "x" * 100, [0, 0, 0], up)
    assert d.replica != r0
    router.forget(r0)
    assert router.tree_chars(r0) == 0
    with pytest.raises(RuntimeError, match="no replica"):
        router.choose("k", [0, 0, 0], [False] * 3)


def test_round_robin_rotates_over_live_replicas():
    router = make_router("round-robin", 3)
    assert isinstance(router, RoundRobinRouter)
    assert [router.choose("same", [0, 0, 0], [True] * 3).replica for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert {router.choose("same", [0, 0, 0], [True, False, True]).replica for _ in range(4)} == {0, 2}
    with pytest.raises(ValueError, match="router must be one of"):
        make_router("random", 2)


def test_router_config_is_validated():
    for bad in ({"imbalance_abs": -1}, {"imbalance_rel": 0.5}, {"min_match_fraction": 2.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RouterConfig(**bad)


def test_routing_keys_preserve_prefixes():
    turn1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "hello"},
                                              {"role": "user", "content": [{"type": "text", "text": "more"}]}]}
    k1, k2 = routing_key("/v1/chat/completions", turn1), routing_key("/v1/chat/completions", turn2)
    assert k2.startswith(k1) and "more" in k2
    with_tools = routing_key("/v1/chat/completions", {**turn1, "tools": [{"type": "function"}]})
    assert with_tools.endswith(k1) and with_tools != k1
    assert routing_key("/v1/completions", {"prompt": "abc"}) == "abc"
    assert routing_key("/v1/completions", {"prompt": ["abc", "def"]}) == "abc"
    ids = routing_key("/generate", {"input_ids": [1, 2, 3]})
    assert ids.startswith(routing_key("/generate", {"input_ids": [1, 2]}))
    assert not ids.startswith(routing_key("/generate", {"input_ids": [1, 23]}))
    assert routing_key("/generate", {"input_ids": [[5, 6], [7]]}) == routing_key("/generate", {"input_ids": [5, 6]})
    assert routing_key("/generate", {"text": "t", "input_ids": [1]}) == "t"
    for path, body in (("/v1/models", {"prompt": "x"}), ("/generate", ["not", "a", "dict"]),
                       ("/generate", {"text": 5}), ("/v1/chat/completions", {"messages": []})):
        assert routing_key(path, body) is None


def test_multi_tenant_benchmark_trace_is_partitioned_by_tenant(monkeypatch):
    """The benchmark's trace through the prefix router (sequential, no load): each tenant's whole
    traffic stays on one replica and the tenants split evenly; round-robin scatters every tenant."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import multi_tenant
    import workloads

    sessions = multi_tenant.build_trace(8, 3, 4, 300, 8, workloads.approx_tokens, workloads.chatml)
    assert [len(s) for s in sessions] == [4] * 24
    tenant_of = [i % 8 for i in range(len(sessions))]  # sessions are interleaved across tenants
    for router, spread in ((PrefixRouter(3), 1), (RoundRobinRouter(3), 3)):
        placed: dict[int, set[int]] = {}
        for turn in range(4):
            for s, reqs in enumerate(sessions):
                d = router.choose(reqs[turn].prompt, [0, 0, 0], [True] * 3)
                placed.setdefault(tenant_of[s], set()).add(d.replica)
        assert all(len(r) == spread for r in placed.values())
        if spread == 1:
            per_replica = [sum(1 for rs in placed.values() if i in rs) for i in range(3)]
            assert sorted(per_replica) == [2, 3, 3]
