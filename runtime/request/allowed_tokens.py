"""vLLM's `allowed_token_ids`: every token a request samples is one of a fixed set.

The set is a grammar-mask row like any other (a packed bitmask of the vocabulary), so the rows that
carry it go through the constrained path unchanged: masks filled while the forward runs, the masked
greedy fast paths, overlap. Without a grammar of its own a request samples from the set alone and
ends as vLLM's does (EOS only where the set holds it, a stop string, max_new_tokens). With one (a
schema, a tool call) `AllowedTokens` intersects the two masks, except that where the grammar may end
its stop tokens stay allowed: the set restricts what the output says, and a grammar's output ends
with a stop token, which a set of content tokens would otherwise turn into a dead end. Jump-forward is
off for such a request: a grammar's forced text may need tokens outside the set.
"""

from __future__ import annotations

import torch

from radixlm.constrained.base import Grammar
from radixlm.constrained.bitmask import bit_is_set, bool_to_bitmask, set_bits


def packed_row(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """The set as one bitmask row of the vocabulary (ids past it refused: the builder checks them)."""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    allowed[torch.tensor([t for t in token_ids if t < vocab_size], dtype=torch.int64)] = True
    return bool_to_bitmask(allowed, (vocab_size + 31) // 32)


class AllowedTokens(Grammar):
    """The request's grammar (`inner`, None when it has none) with every mask cut to `allowed`."""

    __slots__ = ("inner", "allowed", "stop_ids", "_steps")

    def __init__(self, inner: Grammar | None, allowed: torch.Tensor, stop_ids: tuple[int, ...] = ()) -> None:
        self.inner = inner
        self.allowed = allowed  # packed_row's words (shared by copies: never written)
        self.stop_ids = tuple(stop_ids)  # the inner grammar's end tokens, allowed where it allows them
        self._steps = 0  # tokens accepted without an inner grammar (for rollback's bounds)

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
        width = min(bitmask.shape[1], self.allowed.numel())
        bitmask[row, :width].bitwise_and_(self.allowed[:width])
        bitmask[row, width:].zero_()
        if ends:
            set_bits(bitmask, row, self.stop_ids, True)

    def accept(self, token_id: int) -> bool:
        if self.inner is not None:
            return self.inner.accept(token_id)
        self._steps += 1
        return True

    def is_terminated(self) -> bool:
        return self.inner is not None and self.inner.is_terminated()

    def jump_forward(self) -> str | None:
        return None

    def accept_string(self, text: str) -> bool:
        return False

    def rollback(self, k: int) -> None:
        if self.inner is not None:
            self.inner.rollback(k)
            return
        if k > self._steps:
            raise ValueError(f"cannot roll back {k} steps, only {self._steps} were taken")
        self._steps -= k

    def copy(self) -> Grammar:
        twin = AllowedTokens(None if self.inner is None else self.inner.copy(), self.allowed, self.stop_ids)
        twin._steps = self._steps
        return twin
