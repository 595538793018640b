"""One step's sampling for the scheduler: params -> device tensors, grammar masks, draw, one copy back.

Everything stays on the logits' device; the only device->host copies are the sampled ids and, when
some request asked for them, their logprobs. A request whose sampling params, grammar mask or draw
raises is failed alone (finish = abort with the message) and the rest of the batch is sampled
exactly as it would have been without it: rows are independent, so the survivors are re-sampled
row by row with the same inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixlm.runtime.request.req import FinishReason, Req
from radixlm.runtime.sampling.kernels import SamplingBatch, sample

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Sampled:
    next_ids: list[int | None]  # None where the request failed (its finish is set)
    logprobs: list[float | None] | None  # only when some request returns logprobs
    top_logprobs: list[list[tuple[float, int]]] | None


def sample_requests(reqs: list[Req], logits: torch.Tensor, grammars, eos_ids: frozenset[int] = frozenset(),
                    generator: torch.Generator | None = None) -> Sampled:
    """logits [B, V] on the model's device, one row per request; `eos_ids` are held back from a
    request until its min_new_tokens."""
    mask = grammars.vocab_mask(reqs, logits.shape[-1], logits.device)
    try:
        return _sample(reqs, logits, mask, eos_ids, generator)
    except Exception as e:
        logger.warning("sampling a batch of %d failed (%s); isolating the request(s) at fault", len(reqs), e)
    out = Sampled([None] * len(reqs), None, None)
    wants = _wants_logprobs(reqs)
    if wants:
        out.logprobs, out.top_logprobs = [None] * len(reqs), [[] for _ in reqs]
    for i, req in enumerate(reqs):
        if req.finish is not None:
            continue
        try:
            one = _sample([req], logits[i : i + 1], None if mask is None else mask[i : i + 1], eos_ids, generator)
        except Exception as e:
            logger.warning("sampling %s failed: %s", req.rid, e)
            req.finish = FinishReason("abort", message=f"sampling failed: {e}", code=500)
            continue
        out.next_ids[i] = one.next_ids[0]
        if wants and one.logprobs is not None:
            out.logprobs[i] = one.logprobs[0]
            if one.top_logprobs:
                out.top_logprobs[i] = one.top_logprobs[0]
    return out


def _wants_logprobs(reqs: list[Req]) -> bool:
    return any(r.return_logprob for r in reqs)


def _sample(reqs: list[Req], logits: torch.Tensor, mask: torch.Tensor | None, eos_ids: frozenset[int],
            generator: torch.Generator | None) -> Sampled:
    batch = SamplingBatch.build(
        [r.params for r in reqs], [r.input_ids for r in reqs], [r.output_ids for r in reqs],
        logits.shape[-1], logits.device, generator, eos_ids=eos_ids,
    )
    tops = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
    out = sample(logits, batch, mask, tops, logprob_rows=[i for i, r in enumerate(reqs) if r.return_logprob])
    next_ids: list[int | None] = out.next_token_ids.tolist()
    for i, req in enumerate(reqs):
        if req.finish is not None:  # its grammar failed while masking: the token is not used
            next_ids[i] = None
    logprobs = out.logprobs.tolist() if out.logprobs is not None else None
    return Sampled(next_ids, logprobs, out.top_logprobs)
