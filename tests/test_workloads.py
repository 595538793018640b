"""Benchmark workload generators: deterministic, with the shared-prefix structure each workload
promises, and an optimal-hit-rate computation that matches a hand count. Fast: no model, no
tokenizer (a whitespace tokenizer stands in where token ids are needed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads.py"
_spec = importlib.util.spec_from_file_location("radixlm_bench_workloads", _PATH)
wl = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = wl  # dataclasses look their module up while the class is built
_spec.loader.exec_module(wl)


def word_ids(text: str, vocab: dict[str, int]) -> list[int]:
    """A stand-in tokenizer: one id per whitespace-separated word (ids assigned on first sight)."""
    return [vocab.setdefault(w, len(vocab)) for w in text.split()]


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ------------------------------------------------------------------------------------------ determinism


@pytest.mark.parametrize("name", wl.WORKLOADS)
def test_same_seed_same_workload(name):
    a, b = wl.build(name, scale=0.25, seed=7), wl.build(name, scale=0.25, seed=7)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert a.rounds == b.rounds


@pytest.mark.parametrize("name", wl.WORKLOADS)
def test_other_seed_other_workload(name):
    a, b = wl.build(name, scale=0.25, seed=1), wl.build(name, scale=0.25, seed=2)
    assert [r.prompt for r in a.requests] != [r.prompt for r in b.requests]


def test_default_sizes_and_scale():
    assert [len(wl.build(n).requests) for n in wl.WORKLOADS] == [64, 64, 32, 8]
    assert len(wl.build("multi-turn").rounds) == 4
    assert [len(wl.build(n, scale=0.125).requests) for n in wl.WORKLOADS] == [8, 8, 4, 2]
    assert wl.build("few-shot", scale=0.001).requests  # never empty
    with pytest.raises(ValueError, match="unknown workload"):
        wl.build("nope")


# ------------------------------------------------------------------------------------------ structure


def test_few_shot_shares_one_prefix():
    work = wl.few_shot(num_questions=10, prefix_tokens=600, max_new_tokens=16, seed=0)
    prompts = [r.prompt for r in work.requests]
    assert len(set(prompts)) == 10 and len(work.rounds) == 1
    prefix = prompts[0][: prompts[0].rindex("Q: ")]
    assert prefix.startswith(wl.FEW_SHOT_HEADER)
    assert all(p.startswith(prefix) and p.endswith("\nA:") for p in prompts)
    assert wl.approx_tokens(prefix) >= 600
    assert prefix.count("Q: ") >= 10  # k examples before the question
    assert all(r.max_new_tokens == 16 for r in work.requests)
    # the question itself is never one of the examples
    assert all(p[len(prefix):].split("\n")[0] not in prefix for p in prompts)


def test_few_shot_prefix_length_follows_the_counter():
    short = wl.few_shot(2, prefix_tokens=100, count_tokens=lambda s: len(s.split()))
    prefix = short.requests[0].prompt[: short.requests[0].prompt.rindex("Q: ")]
    assert 100 <= len(prefix.split()) < 140  # stops at the first example that reaches the target


def test_multi_turn_resends_history():
    work = wl.multi_turn(num_conversations=3, turns=4, max_new_tokens=32, seed=0)
    assert [len(rnd) for rnd in work.rounds] == [3, 3, 3, 3]
    assert all(r.round == t for t, rnd in enumerate(work.rounds) for r in rnd)
    convs = wl.conversations(3, 4, seed=0)
    for c in range(3):
        turns = [rnd[c] for rnd in work.rounds]
        assert all(r.group == c for r in turns)
        for t in range(1, 4):
            prev, cur = turns[t - 1].prompt, turns[t].prompt
            # turn t = turn t-1 + the scripted reply of turn t-1 + the new user message
            assert cur.startswith(prev + convs[c][t - 1][1] + "<|im_end|>\n")
            assert cur.endswith(convs[c][t][0] + "<|im_end|>\n<|im_start|>assistant\n")
    # different conversations share only the rendering's opening
    firsts = [r.prompt for r in work.rounds[0]]
    assert common_prefix(firsts[0], firsts[1]) < 60


def test_multi_turn_uses_the_given_renderer():
    seen = []

    def render(messages):
        seen.append([dict(m) for m in messages])
        return "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"

    work = wl.multi_turn(num_conversations=2, turns=3, seed=0, render=render)
    assert len(seen) == 6 and [m["role"] for m in seen[-1]] == ["user", "assistant", "user", "assistant", "user"]
    assert work.rounds[2][1].prompt.startswith(work.rounds[1][1].prompt[: -len("|assistant:")])


def test_unique_prompts_share_almost_nothing():
    work = wl.unique(num_prompts=32, seed=0)
    prompts = [r.prompt for r in work.requests]
    assert len(set(prompts)) == 32
    for i, p in enumerate(prompts):
        assert 75 <= len(p.split()) <= 170
        for q in prompts[:i]:
            assert common_prefix(p, q) < 16  # the opening word at most
    assert all(r.max_new_tokens == 128 for r in work.requests)
    vocab: dict[str, int] = {}
    assert wl.optimal_hit_rate([word_ids(p, vocab) for p in prompts]) < 0.01


def test_sampling_params_are_greedy_and_ignore_eos():
    req = wl.build("unique", scale=0.1).requests[0]
    assert wl.sampling_params(req) == {"max_new_tokens": 128, "temperature": 0.0, "ignore_eos": True}


def test_sample_keeps_whole_conversations_or_first_of_each_round():
    work = wl.multi_turn(num_conversations=4, turns=3)
    by_group = work.sample(7)  # two whole conversations (6 requests) fit, a third would not
    assert {r.group for r in by_group.requests} == {0, 1}
    assert [len(rnd) for rnd in by_group.rounds] == [2, 2, 2]
    per_round = work.sample(3, per_round=True)  # the first 3 of every turn: conversations 0-2
    assert [[r.group for r in rnd] for rnd in per_round.rounds] == [[0, 1, 2]] * 3
    assert work.sample(None) is work and work.sample(100) is work
    assert len(work.sample(1).requests) == 3  # at least one whole group
    few = wl.few_shot(10)
    assert few.sample(4, per_round=True).requests == few.requests[:4] == few.sample(4).requests


# ------------------------------------------------------------------------------------------ optimal hit rate


def test_shared_prefix_lengths_by_hand():
    trace = [
        [1, 2, 3, 4],  # first: nothing before it
        [1, 2, 3, 5, 6],  # shares [1, 2, 3] with #0
        [1, 2, 3, 5, 7, 8],  # shares [1, 2, 3, 5] with #1 (longer than with #0)
        [9, 9],  # nothing
        [1, 2],  # a prefix of earlier prompts: all of it
        [1, 2, 3, 4],  # a repeat of #0: all of it
    ]
    assert wl.shared_prefix_lengths(trace) == [0, 3, 4, 0, 2, 4]
    total = 4 + 5 + 6 + 2 + 2 + 4
    assert wl.optimal_hit_rate(trace, recompute_last=False) == pytest.approx((3 + 4 + 2 + 4) / total)
    # a real cache must still run the last token of a fully shared prompt: 2 -> 1 and 4 -> 3
    assert wl.optimal_hit_rate(trace) == pytest.approx((3 + 4 + 1 + 3) / total)


def test_optimal_hit_rate_edge_cases():
    assert wl.optimal_hit_rate([]) == 0.0
    assert wl.optimal_hit_rate([[5, 6, 7]]) == 0.0
    assert wl.shared_prefix_lengths([[1], [2], [1]]) == [0, 0, 1]


def test_optimal_hit_rate_of_few_shot_is_high():
    vocab: dict[str, int] = {}
    work = wl.few_shot(num_questions=16, prefix_tokens=600)
    ids = [word_ids(r.prompt, vocab) for r in work.requests]
    prefix_words = len(work.requests[0].prompt[: work.requests[0].prompt.rindex("Q: ")].split())
    shared = wl.shared_prefix_lengths(ids)
    assert shared[0] == 0 and all(s >= prefix_words for s in shared[1:])
    assert wl.optimal_hit_rate(ids) > 0.85
