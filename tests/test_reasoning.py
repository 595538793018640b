"""Reasoning models: the thinking split off the answer (server/reasoning.py), streamed and whole alike,
and the constraint that sleeps while the model thinks (runtime/request/reasoning.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.constrained.base import Grammar
from radixlm.constrained.bitmask import allocate_bitmask, bitmask_to_bool
from radixlm.runtime.launch_flags import REASONING_PARSERS
from radixlm.runtime.request.reasoning import REASONING_FORMATS, AfterThinking
from radixlm.server.reasoning import ThinkingSplit, split

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek-r1"]


def test_every_parser_flag_has_a_format():
    assert set(REASONING_PARSERS) == set(REASONING_FORMATS)


@pytest.mark.parametrize("fmt,text,want", [
    (QWEN3, "<think>\nfirst plan\n</think>\n\nThe answer.", ("first plan", "The answer.", False)),
    (QWEN3, "  <think>a</think>b", ("a", "b", False)),
    (QWEN3, "No thinking here </think> at all", (None, "No thinking here </think> at all", False)),
    (QWEN3, "<think>\ncut short ", ("cut short", "", True)),
    (QWEN3, "<think></think>\n{}", (None, "{}", False)),
    (QWEN3, "<thin", (None, "<thin", False)),
    (QWEN3, "", (None, "", False)),
    (R1, "plan</think>answer", ("plan", "answer", False)),
    (R1, "<think>plan</think>\nanswer", ("plan", "answer", False)),
    (R1, "still thinking", ("still thinking", "", True)),
    (R1, "a </thi", ("a </thi", "", True)),
])
def test_split(fmt, text, want):
    assert split(text, fmt) == want


PIECES = ["<think>", "</think>", "<thi", "</", "nk>", " ", "\n", "plan", "x", "{\"a\": 1}", "é"]


@settings(max_examples=examples(300), deadline=None)
@given(fmt=st.sampled_from([QWEN3, R1]), parts=st.lists(st.sampled_from(PIECES), max_size=12), data=st.data(),
       stream=st.booleans())
def test_streamed_deltas_concatenate_to_the_whole_split(fmt, parts, data, stream):
    """Streamed or not (stream_reasoning), the deltas add up to the whole answer's fields; not
    streamed, the thinking is one delta, and no content comes before it."""
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    reader = ThinkingSplit(fmt, stream=stream)
    got = {"reasoning_content": "", "content": ""}
    deltas = [d for c in chunks for d in reader.feed(c)] + reader.finish()
    for delta in deltas:
        assert len(delta) == 1 and all(delta.values()), delta  # one field a delta, never empty
        for key, value in delta.items():
            got[key] += value
    thought, content, still_open = split(text, fmt)
    assert (got["reasoning_content"] or None, got["content"]) == (thought, content)
    assert reader.open == still_open
    if not stream:
        kinds = [next(iter(d)) for d in deltas]
        assert kinds.count("reasoning_content") <= 1 and "reasoning_content" not in kinds[1:]


# ------------------------------------------------------------------------ the sleeping constraint
VOCAB, EOS, START, END = 64, 2, 60, 61
DIGITS = range(10, 20)


class Digits(Grammar):
    """A stand-in grammar: one or more digit tokens, then EOS."""

    def __init__(self):
        self.taken: list[int] = []

    def fill_mask(self, bitmask, row):
        allowed = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
        allowed[list(DIGITS)] = not self.is_terminated()
        allowed[EOS] = bool(self.taken)
        bits = allowed.view(-1, 32).to(torch.int64) << torch.arange(32)
        words = bits.sum(dim=1)
        bitmask[row] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    def accept(self, token_id):
        ok = (token_id in DIGITS and not self.is_terminated()) or (token_id == EOS and bool(self.taken))
        if ok:
            self.taken.append(token_id)
        return ok

    def is_terminated(self):
        return bool(self.taken) and self.taken[-1] == EOS

    def jump_forward(self):
        return None

    def accept_string(self, text):
        return False

    def rollback(self, k):
        if k > len(self.taken):
            raise ValueError("past the history")
        del self.taken[len(self.taken) - k:]

    def copy(self):
        twin = Digits()
        twin.taken = list(self.taken)
        return twin


def allowed(grammar) -> set[int]:
    mask = allocate_bitmask(1, VOCAB)
    grammar.fill_mask(mask, 0)
    return set(torch.nonzero(bitmask_to_bool(mask, VOCAB)[0]).flatten().tolist())


@pytest.mark.parametrize("forced", [True, False])
def test_the_constraint_judges_only_what_follows_the_thinking(forced):
    g = AfterThinking(Digits(), START, END, forced, stop_ids=(EOS,))
    if not forced:  # the first token chooses: the grammar's own, or the start of a thinking block
        assert allowed(g) == set(DIGITS) | {START}
        assert g.accept(START)
    thinking = allowed(g)
    assert thinking == set(range(VOCAB)) - {EOS}  # anything but an end without an answer
    for token in (40, 5, START, 33):
        assert g.accept(token) and not g.is_terminated()
    assert not g.accept(EOS)
    assert g.accept(END)
    assert allowed(g) == set(DIGITS)  # awake: the grammar's mask, from its start
    assert not g.accept(40)
    assert g.accept(12) and allowed(g) == set(DIGITS) | {EOS}
    twin = g.copy()
    assert g.accept(EOS) and g.is_terminated()
    assert not twin.is_terminated() and twin.accept(13)
    g.rollback(2)  # EOS and 12: awake at the grammar's start again
    assert allowed(g) == set(DIGITS)
    g.rollback(1)  # the end token: thinking again
    assert allowed(g) == thinking


def test_an_answer_without_thinking_wakes_the_grammar_at_once():
    g = AfterThinking(Digits(), START, END, False, stop_ids=(EOS,))
    assert not g.accept(40)  # neither a start nor the grammar's
    assert g.accept(11) and allowed(g) == set(DIGITS) | {EOS}
    g.rollback(1)
    assert allowed(g) == set(DIGITS) | {START}
