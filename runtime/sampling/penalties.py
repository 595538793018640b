"""Repetition, frequency and presence penalties as sparse flat positions, and the running token
counts that spare a request from rescanning its whole history every step.

A row's penalties only touch the tokens it has seen, so they are kept as flat positions
``row * vocab_size + token`` with a value each: the cost follows the history, not B x V. A request
with penalties keeps a `TokenHistory` (Req.token_history): the distinct tokens of its prompt and the
counts of its output tokens, brought up to date with the tokens added since the last step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from radixlm.runtime.request.params import SamplingParams

if TYPE_CHECKING:
    from radixlm.runtime.sampling.kernels import SamplingBatch

# output tokens compared to notice a rewrite: jump-forward retokenizes the last token with the
# forced text (scheduler/grammars.py), which may change it and what follows
_TAIL = 8


class TokenHistory:
    """The distinct prompt tokens and the output token counts of one request."""

    __slots__ = ("prompt_len", "prompt_distinct", "output_counts", "covered", "tail")

    def __init__(self) -> None:
        self.prompt_len = -1
        self.prompt_distinct: dict[int, None] = {}
        self.output_counts: dict[int, int] = {}
        self.covered = 0  # output tokens counted
        self.tail: list[int] = []  # the last _TAIL of them, to notice a rewrite

    def sync(self, prompt: list[int], output: list[int]) -> None:
        """Counts the output tokens added since the last call; starts over when what was counted
        changed (a jump-forward rewrite, a retraction that kept the output) or the prompt did."""
        if len(prompt) != self.prompt_len:
            self.prompt_len = len(prompt)
            self.prompt_distinct = dict.fromkeys(prompt)
        n = self.covered
        if n > len(output) or output[max(0, n - _TAIL) : n] != self.tail:
            self.output_counts, n = {}, 0
        counts = self.output_counts
        for t in output[n:]:
            counts[t] = counts.get(t, 0) + 1
        self.covered = len(output)
        self.tail = output[-_TAIL:]

    def distinct(self) -> list[int]:
        """Distinct tokens of prompt and output."""
        return list(self.prompt_distinct.keys() | self.output_counts.keys())


def build_penalties(
    params: list[SamplingParams],
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
    eos_ids: Iterable[int] = (),
    histories: list[TokenHistory | None] | None = None,
) -> dict[str, torch.Tensor | None]:
    """Flat positions and values of the repetition and frequency / presence penalties, and of the
    logit_bias / min_new_tokens adjustments. A row with a `TokenHistory` reads its distinct tokens
    and counts from it instead of rescanning its prompt and output."""
    pen: dict[str, torch.Tensor | None] = dict.fromkeys(
        ("repetition_index", "repetition_factor", "frequency_index", "frequency_delta", "adjust_index",
         "adjust_value")
    )

    def positions(rows: list[int], tokens: list[list[int]], distinct: bool = False) -> torch.Tensor:
        """Flat positions row * V + token; `distinct`: each row's tokens are distinct already."""
        lengths = torch.tensor([len(h) for h in tokens], dtype=torch.int64)
        row_ids = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
        flat = row_ids * vocab_size + torch.tensor([t for h in tokens for t in h], dtype=torch.int64)
        return flat if distinct else flat.unique()

    def history(i: int) -> TokenHistory | None:
        h = None if histories is None else histories[i]
        if h is not None:
            h.sync(prompt_ids[i], output_ids[i])
        return h

    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rows:
        kept = [history(i) for i in rows]
        if all(h is not None for h in kept):
            flat = positions(rows, [h.distinct() for h in kept], distinct=True)
        else:
            flat = positions(rows, [prompt_ids[i] + output_ids[i] for i in rows])
        factors = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        pen["repetition_index"] = flat.to(device)
        pen["repetition_factor"] = factors[flat // vocab_size].to(device)
    rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if rows:
        kept = [history(i) for i in rows]
        if all(h is not None for h in kept):
            flat = positions(rows, [list(h.output_counts) for h in kept], distinct=True)
            counts = torch.tensor([c for h in kept for c in h.output_counts.values()], dtype=torch.int64)
        else:
            flat, counts = positions(rows, [output_ids[i] for i in rows], distinct=True).unique(return_counts=True)
        row_of = flat // vocab_size
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)[row_of]
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)[row_of]
        pen["frequency_index"] = flat.to(device)
        pen["frequency_delta"] = (freq * counts + presence).to(device)
    adjust: list[tuple[int, float]] = []
    for i, p in enumerate(params):
        adjust += logit_bias_adjust(i, p, vocab_size)
        if len(output_ids[i]) < p.min_new_tokens and p.constraint is None:
            held = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            adjust += [(i * vocab_size + t, float("-inf")) for t in held if t < vocab_size]
    if adjust:
        pen["adjust_index"] = torch.tensor([a for a, _ in adjust], dtype=torch.int64, device=device)
        pen["adjust_value"] = torch.tensor([v for _, v in adjust], dtype=torch.float32, device=device)
    return pen


def logit_bias_adjust(row: int, p: SamplingParams, vocab_size: int) -> list[tuple[int, float]]:
    """(flat position, bias) of one row's logit_bias, in the order it was given."""
    if not p.logit_bias:
        return []
    return [(row * vocab_size + t, b) for t, b in p.logit_bias.items() if t < vocab_size]


def apply_penalties_(x: torch.Tensor, batch: SamplingBatch) -> None:
    """Penalize the logits ``x`` [B, V] in place (HF repetition, then OpenAI frequency/presence)."""
    flat = x.view(-1)
    if batch.repetition_index is not None:
        index, r = batch.repetition_index, batch.repetition_factor
        seen = flat[index]
        flat[index] = torch.where(seen > 0, seen / r, seen * r)
    if batch.frequency_index is not None:
        flat.index_add_(0, batch.frequency_index, batch.frequency_delta, alpha=-1)
    if batch.adjust_index is not None:
        flat.index_add_(0, batch.adjust_index, batch.adjust_value)
