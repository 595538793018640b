"""One step's sampling for the scheduler: params -> device tensors, grammar masks, draw.

Everything stays on the logits' device until the scheduler's resolve copies the sampled ids back
(and, when some request asked for them, their logprobs): ``sample_on_device`` is the launch half,
``DeviceSampled.host`` the resolve half. A request whose sampling params, grammar mask or draw
raises is failed alone (finish = abort with the message) and the rest of the batch is sampled
exactly as it would have been without it: rows are independent, so the survivors are re-sampled
row by row with the same inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.runtime.request.req import FinishReason, Req
from radixlm.runtime.sampling.kernels import SamplingBatch, sample
from radixlm.runtime.sampling.penalties import TokenHistory

if TYPE_CHECKING:
    from radixlm.runtime.executor.compute_thread import Task

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Sampled:
    """One step's draws on the host."""

    next_ids: list[int | None]  # None where the request failed (its finish is set)
    logprobs: list[float | None] | None  # only when some request returns logprobs
    top_logprobs: list[list[tuple[float, int]]] | None
    token_ids_logprobs: list[list[tuple[float, int]]] | None = None  # token_ids_logprob, per row


@dataclass(slots=True)
class DeviceSampled:
    """One step's draws still on the logits' device: the scheduler's launch makes it, its resolve
    copies it back (one copy of the ids, plus the logprobs when some request asked)."""

    next_ids: torch.Tensor  # int64 [B], on the device (an overlapped next step reads its inputs here)
    logprobs: torch.Tensor | None  # float32 [B] (NaN where not asked), None when no row asked
    top_logprobs: list[list[tuple[float, int]]] | None
    failed: list[bool]  # rows whose request failed while sampling (its finish is set)
    token_ids_logprobs: list[list[tuple[float, int]]] | None = None  # token_ids_logprob, per row (host)
    # on CUDA, started by `start_copy` right behind the draws: pinned host copies, and their event
    host_ids: torch.Tensor | None = None
    host_logprobs: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None

    def start_copy(self) -> DeviceSampled:
        """Queues the copy back on the launching thread's stream, right behind this step's draws.
        With overlap, step N+1 is queued before the host resolves step N; a copy queued by the resolve
        would wait behind N+1's whole forward, so the host would idle through N+1 and then the GPU
        through the host's resolve and schedule. On the CPU there is nothing to copy."""
        if self.next_ids.device.type == "cuda":
            self.host_ids = self.next_ids.to("cpu", non_blocking=True)  # into pinned memory
            if self.logprobs is not None:
                self.host_logprobs = self.logprobs.to("cpu", non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        return self

    def host(self) -> Sampled:
        if self.copied is not None:
            self.copied.synchronize()  # this step's draws only, not what was queued after them
        ids_t = self.next_ids if self.host_ids is None else self.host_ids
        lp_t = self.logprobs if self.host_logprobs is None else self.host_logprobs
        ids: list[int | None] = ids_t.tolist()
        logprobs = None if lp_t is None else lp_t.tolist()
        for i, failed in enumerate(self.failed):
            if failed:
                ids[i] = None
                if logprobs is not None:
                    logprobs[i] = None
        return Sampled(ids, logprobs, self.top_logprobs, self.token_ids_logprobs)


def sample_requests(reqs: list[Req], logits: torch.Tensor, grammars, eos_ids: frozenset[int] = frozenset(),
                    generator: torch.Generator | None = None) -> Sampled:
    """sample_on_device, copied to the host."""
    return sample_on_device(reqs, logits, grammars, eos_ids, generator).host()


def sample_on_device(reqs: list[Req], logits: torch.Tensor, grammars, eos_ids: frozenset[int] = frozenset(),
                     generator: torch.Generator | None = None, prebuilt: SamplingBatch | None = None,
                     masks: Task | None = None) -> DeviceSampled:
    """logits [B, V] on the model's device, one row per request; `eos_ids` are held back from a
    request until its min_new_tokens. `prebuilt`: the rows' SamplingBatch, built when the step was
    scheduled (an overlapped step's rows are still being resolved when it samples). `masks`: the
    rows' masks as `grammars.fill_masks` leaves them, filled on another thread while the forward ran
    (waited for here, before anything reads a request's `finish`: a failed grammar sets it there);
    None: they are filled here."""
    filled = grammars.fill_masks(reqs, logits.shape[-1], logits.device) if masks is None else masks.result()
    mask = grammars.device_mask(filled, logits.shape[-1], logits.device)
    try:
        return _sample(reqs, logits, mask, eos_ids, generator, prebuilt)
    except Exception as e:
        logger.warning("sampling a batch of %d failed (%s); isolating the request(s) at fault", len(reqs), e)
    ids = torch.zeros(len(reqs), dtype=torch.int64, device=logits.device)
    wants = _wants_logprobs(reqs)
    logprobs = torch.full((len(reqs),), float("nan"), device=logits.device) if wants else None
    tops: list[list[tuple[float, int]]] | None = [[] for _ in reqs] if wants else None
    asked: list[list[tuple[float, int]]] | None = [[] for _ in reqs] if wants else None
    failed = [req.finish is not None for req in reqs]
    for i, req in enumerate(reqs):
        if failed[i]:
            continue
        try:
            one = _sample([req], logits[i : i + 1], None if mask is None else mask[i : i + 1], eos_ids, generator)
        except Exception as e:
            logger.warning("sampling %s failed: %s", req.rid, e)
            req.finish = FinishReason("abort", message=f"sampling failed: {e}", code=500)
            failed[i] = True
            continue
        ids[i] = one.next_ids[0]
        if logprobs is not None and one.logprobs is not None:
            logprobs[i] = one.logprobs[0]
            if one.top_logprobs:
                tops[i] = one.top_logprobs[0]
            if one.token_ids_logprobs:
                asked[i] = one.token_ids_logprobs[0]
    return DeviceSampled(ids, logprobs, tops, failed, asked)


def _history(req: Req) -> TokenHistory | None:
    """The running token counts of a request with penalties (kept on it from step to step)."""
    if req.token_history is None and req.params.has_penalties:
        req.token_history = TokenHistory()
    return req.token_history


def _wants_logprobs(reqs: list[Req]) -> bool:
    return any(r.return_logprob for r in reqs)


def _sample(reqs: list[Req], logits: torch.Tensor, mask: torch.Tensor | None, eos_ids: frozenset[int],
            generator: torch.Generator | None, prebuilt: SamplingBatch | None = None) -> DeviceSampled:
    batch = prebuilt or SamplingBatch.build(
        [r.params for r in reqs], [r.input_ids for r in reqs], [r.output_ids for r in reqs],
        logits.shape[-1], logits.device, generator, eos_ids=eos_ids, histories=[_history(r) for r in reqs],
    )
    tops = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
    asked = [r.token_ids_asked for r in reqs]
    out = sample(logits, batch, mask, tops, logprob_rows=[i for i, r in enumerate(reqs) if r.return_logprob],
                 token_ids=asked if any(asked) else None)
    # a request whose grammar failed while masking has its finish set: its token is not used
    return DeviceSampled(out.next_token_ids, out.logprobs, out.top_logprobs, [r.finish is not None for r in reqs],
                         out.token_ids_logprobs)
