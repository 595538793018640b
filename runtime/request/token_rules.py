"""vLLM's `allowed_token_ids` and `bad_words`: rules on the tokens a request may sample.

- `allowed_token_ids`: every sampled token is one of a fixed set.
- `bad_words`: a word's last token is refused wherever the output so far ends with the word's other
  tokens, so the word is never completed (a one-token word is refused everywhere). Each word counts as
  tokenized on its own and, where that gives a different first token of the same count, after a
  space: a word at the start of the text and one inside it (`bad_word_ids`).

The rules are a grammar-mask row like any other (a packed bitmask of the vocabulary), so the rows that
carry them go through the constrained path unchanged: masks filled while the forward runs, the masked
greedy fast paths, overlap. Without a grammar of its own a request samples under the rules alone and
ends as vLLM's does (EOS only where the set holds it, a stop string, max_new_tokens). With one (a
schema, a tool call) `TokenRules` applies them to the grammar's mask, except that where the grammar
may end its stop tokens stay allowed: the rules restrict what the output says, and a grammar's output
ends with a stop token, which a set of content tokens would otherwise turn into a dead end.
Jump-forward is off for such a request: a grammar's forced text may break a rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from radixlm.constrained.base import Grammar
from radixlm.constrained.bitmask import bit_is_set, set_bits


def bad_word_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[tuple[int, ...]]:
    """The token sequences `bad_words` refuse: each word as its own text, and after a space where that
    spells it with another first token and as many tokens (so it is a word inside a text too)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip()))
        if not alone:
            continue
        sequences.append(alone)
        spaced = tuple(encode(" " + word.lstrip()))
        if len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return sequences


class TokenRules(Grammar):
    """The request's grammar (`inner`, None when it has none) under `allowed` (a packed row, or None)
    and the `banned` token sequences."""

    __slots__ = ("inner", "allowed", "banned", "stop_ids", "_history")

    def __init__(self, inner: Grammar | None, allowed: torch.Tensor | None, banned: Sequence[tuple[int, ...]] = (),
                 stop_ids: Sequence[int] = ()) -> None:
        self.inner = inner
        self.allowed = allowed  # one bitmask row (shared by copies: never written)
        self.banned = tuple(banned)
        self.stop_ids = tuple(stop_ids)  # the inner grammar's end tokens, allowed where it allows them
        self._history: list[int] = []  # the tokens accepted (bad words read the output's end; rollback)

    @property
    def error_message(self) -> str | None:
        return getattr(self.inner, "error_message", None)

    def pending_check(self):
        pending = getattr(self.inner, "pending_check", None)
        return pending() if pending is not None else None

    def batch_target(self) -> Grammar | None:
        return None if self.inner is None else self.inner.batch_target()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        ends = False
        if self.inner is None:
            bitmask[row].fill_(-1)
        else:
            self.inner.fill_mask(bitmask, row)
            ends = bit_is_set(bitmask, row, self.stop_ids)
        if self.allowed is not None:
            width = min(bitmask.shape[1], self.allowed.numel())
            bitmask[row, :width].bitwise_and_(self.allowed[:width])
            bitmask[row, width:].zero_()
        history = self._history
        refused = [word[-1] for word in self.banned
                   if len(word) == 1 or (len(history) >= len(word) - 1 and tuple(history[1 - len(word):]) == word[:-1])]
        if refused:
            set_bits(bitmask, row, refused, False)
        if ends:
            set_bits(bitmask, row, self.stop_ids, True)

    def accept(self, token_id: int) -> bool:
        if self.inner is not None and not self.inner.accept(token_id):
            return False
        self._history.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def jump_forward(self) -> str | None:
        return None

    def accept_string(self, text: str) -> bool:
        return False

    def rollback(self, k: int) -> None:
        if k > len(self._history):
            raise ValueError(f"cannot roll back {k} steps, only {len(self._history)} were taken")
        if self.inner is not None:
            self.inner.rollback(k)
        del self._history[len(self._history) - k:]

    def copy(self) -> Grammar:
        twin = TokenRules(None if self.inner is None else self.inner.copy(), self.allowed, self.banned, self.stop_ids)
        twin._history = list(self._history)
        return twin
