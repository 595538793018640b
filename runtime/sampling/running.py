"""Sampling state kept with the running decode batch: filtered when rows leave, merged when rows join.

A decode step samples every running request. Building its `SamplingBatch` from the requests' params
means Python over every row and a handful of small host-to-device copies; most steps run exactly
the rows of the step before, and the others lose a few finished rows or gain a few admitted ones at
the end. So the scheduler keeps the last decode step's batch (`RunningSampling`): the same rows
reuse it, and `update_rows` filters out the rows that left and merges in the rows that joined,
selecting the kept rows' tensors on their device (nothing is read back).

Only rows whose settings are the same at every step are kept (`step_invariant`): a seeded row mixes
the step into its seed, penalties read the token ids, and a row short of its min_new_tokens holds
EOS back. A batch with such a row is built afresh every step, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.request.req import Req
from radixlm.runtime.sampling.kernels import SamplingBatch, row_flags, sampled_rows
from radixlm.runtime.sampling.penalties import logit_bias_adjust

_SETTINGS = ("temperatures", "top_ks", "top_ps", "min_ps")  # one entry per sampled row, in row order


def step_invariant(req: Req) -> bool:
    """A row whose sampling settings are the same at every step: no seed (it mixes in the step), no
    penalties (they read the ids), min_new_tokens already reached (it holds EOS back until then)."""
    p = req.params
    return p.sampling_seed is None and not p.has_penalties and len(req.output_ids) >= p.min_new_tokens


def update_rows(batch: SamplingBatch, keep: list[int], joined: list[SamplingParams]) -> SamplingBatch:
    """`batch`'s rows `keep` (in that order), then rows for `joined`, all step-invariant: the fields
    `SamplingBatch.build` gives for those rows (`_settings` says which tensors are reused, selected
    on their device or copied from the params)."""
    _check_kept(batch)
    params = [batch.row_params[i] for i in keep] + joined
    vocab, device = batch.vocab_size, batch.temperatures.device
    sampled, top_ks = sampled_rows(params, vocab)
    settings = _settings(batch, keep, params, sampled, top_ks, device)
    adjust = [a for i, p in enumerate(params) if p.logit_bias for a in logit_bias_adjust(i, p, vocab)]
    temperatures, top_ks_t, top_ps, min_ps = settings
    return SamplingBatch(
        temperatures=temperatures, top_ks=top_ks_t, top_ps=top_ps, min_ps=min_ps, seeded=[],
        has_penalties=bool(adjust), repetition_index=None, repetition_factor=None, frequency_index=None,
        frequency_delta=None,
        adjust_index=torch.tensor([a for a, _ in adjust], dtype=torch.int64, device=device) if adjust else None,
        adjust_value=torch.tensor([v for _, v in adjust], dtype=torch.float32, device=device) if adjust else None,
        generator=batch.generator, **row_flags(params, sampled, top_ks, vocab, device),
    )


class RunningSampling:
    """The SamplingBatch of the last decode step and the requests it was built for."""

    def __init__(self, vocab_size: int, device: torch.device, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_ids = frozenset(eos_ids)
        self._reqs: list[Req] = []  # the objects themselves (held, so no id is reused meanwhile)
        self._batch: SamplingBatch | None = None
        self.reused = self.filtered = self.merged = self.built = 0  # steps served each way

    def for_rows(self, reqs: list[Req]) -> SamplingBatch | None:
        """The SamplingBatch for a decode step over `reqs`, or None when a row depends on the step
        (the launch builds one then)."""
        kept, batch = self._reqs, self._batch
        self._reqs, self._batch = reqs, None
        if batch is not None and len(kept) == len(reqs) and all(a is b for a, b in zip(kept, reqs)):
            self._batch = batch
            self.reused += 1
            return batch
        keep = _kept_prefix(kept, reqs) if batch is not None else []
        # kept rows were step-invariant when kept and stay so (params are fixed, outputs only grow)
        if not all(step_invariant(r) for r in reqs[len(keep):]):
            return None
        if not keep:
            self._batch = SamplingBatch.build([r.params for r in reqs], [r.input_ids for r in reqs],
                                              [r.output_ids for r in reqs], self.vocab_size, self.device,
                                              eos_ids=self.eos_ids)
            self.built += 1
            return self._batch
        joined = [r.params for r in reqs[len(keep):]]
        self.filtered += len(keep) < len(kept)
        self.merged += bool(joined)
        self._batch = update_rows(batch, keep, joined)
        return self._batch


def _kept_prefix(kept: list[Req], reqs: list[Req]) -> list[int]:
    """Indices into `kept` of the leading rows of `reqs` that were kept, when they are in their old
    order and none of the rows after them was kept (rows left, or joined at the end); else []."""
    keep: list[int] = []
    i, n = 0, len(kept)
    for r in reqs:
        while i < n and kept[i] is not r:
            i += 1
        if i == n:
            break
        keep.append(i)
        i += 1
    if len(keep) < len(reqs):  # the rest joined: none of them may be a row kept before
        left = {id(r) for r in kept}
        if any(id(r) in left for r in reqs[len(keep):]):
            return []
    return keep


def _check_kept(batch: SamplingBatch) -> None:
    if batch.seeded or batch.repetition_index is not None or batch.frequency_index is not None:
        raise ValueError("only a batch of step-invariant rows (no seeds, no penalties) can be filtered or merged")
    if len(batch.row_params) != batch.batch_size:
        raise ValueError("this SamplingBatch was not built with its rows' params")


def _settings(batch: SamplingBatch, keep: list[int], params: list[SamplingParams], sampled: list[int],
              top_ks: list[int], device: torch.device) -> list[torch.Tensor]:
    """The sampled rows' setting tensors. Kept rows only: `batch`'s, selected on their device (as
    they are when every sampled row stays). When sampled rows joined, one copy per setting from the
    params, as `build` does: fewer ops than selecting and concatenating. (No sampled row left: the
    selection is empty.)"""
    if len(sampled) > sum(not batch.row_params[i].greedy for i in keep):  # sampled rows joined
        sp = [params[i] for i in sampled]
        return [torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=device),
                torch.tensor(top_ks, dtype=torch.int64, device=device),
                torch.tensor([p.top_p for p in sp], dtype=torch.float32, device=device),
                torch.tensor([p.min_p for p in sp], dtype=torch.float32, device=device)]
    was_sampled = [i for i, p in enumerate(batch.row_params) if not p.greedy]
    position = {row: j for j, row in enumerate(was_sampled)}
    picks = [position[i] for i in keep if i in position]
    kept = [getattr(batch, name) for name in _SETTINGS]
    if picks == list(range(len(was_sampled))):
        return kept
    index = torch.tensor(picks, dtype=torch.int64, device=device)
    return [t.index_select(0, index) for t in kept]
