"""Turn a batch of next-token logits into chosen token ids, their logprobs and top alternatives.

Per decode step the scheduler builds one ``SamplingBatch`` from the running requests' params and
token histories, then calls ``sample(logits, batch, vocab_mask, top_logprobs_nums)``. The order of
operations on each row:

    raw logits --(logprobs are read here)--> repetition / frequency / presence penalties
      -> grammar mask -> greedy rows: argmax (lowest id on ties)
                      -> other rows: temperature -> top_k -> top_p -> min_p -> draw

Filtering is done with per-row probability thresholds (a token is kept when its probability is at
least the row's threshold), so it is vectorized over the batch and independent of how ties are
ordered by a sort. The draw is an inverse-CDF lookup in token-id order with one uniform number per
row; a seeded row takes its number from a generator seeded by (sampling_seed, tokens generated so
far), so its output does not depend on the other rows of the batch or on how batches are split.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from radixlm.constrained.bitmask import allowed, bitmask_to_bool, masked_argmax, refused_out, sparse_rows
from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.sampling.penalties import TokenHistory, apply_penalties_, build_penalties

# On CPU, top_p without top_k first looks for the nucleus among this many most likely tokens (a
# partial sort, several times cheaper than sorting the whole vocabulary) and sorts everything only
# when the nucleus is larger.
_TOP_P_CANDIDATES = 1024
# Rows are split into chunks of one of these sizes for the CPU argmax (see _argmax): larger chunks
# make the pass over chunk maxima shorter (49,152 logits: 512).
_ARGMAX_CHUNKS = (512, 256, 128)
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingBatch:
    """Per-step tensors for a batch of B rows, built once per decode step from the running requests.

    Only the sampled (non-greedy) rows get temperature / top-k / top-p / min-p tensors. Penalties
    are sparse: flat positions ``row * vocab_size + token`` of the tokens a row has seen, so their
    cost follows the history length, not B x V.
    """

    batch_size: int
    vocab_size: int
    all_greedy: bool
    # Sampled rows: their positions in the batch (None = all B rows) and their settings, [S] each.
    sample_rows: torch.Tensor | None
    temperatures: torch.Tensor  # float32, > 0
    top_ks: torch.Tensor  # int64 in [1, vocab_size]; vocab_size means off
    top_ps: torch.Tensor  # float32 in (0, 1]
    min_ps: torch.Tensor  # float32 in [0, 1]
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    sort_width: int  # how many most likely tokens top_k / top_p look at first (see _sorted_threshold)
    # (index among the sampled rows, generator seed) for every sampled row with a sampling_seed.
    seeded: list[tuple[int, int]]
    scale_temperature: bool  # False when every sampled row has temperature 1
    # Penalties (no penalty work at all when has_penalties is False).
    has_penalties: bool
    repetition_index: torch.Tensor | None  # int64 [N]: distinct tokens of prompt + output, per row
    repetition_factor: torch.Tensor | None  # float32 [N]: that row's repetition_penalty
    frequency_index: torch.Tensor | None  # int64 [M]: distinct tokens of the output, per row
    frequency_delta: torch.Tensor | None  # float32 [M]: frequency_penalty * count + presence_penalty
    # Sparse per-row additions: logit_bias, and -inf on stop ids / EOS while a row is short of
    # min_new_tokens (rows with a grammar are left to it: their mask may allow only EOS).
    adjust_index: torch.Tensor | None  # int64 [K]: flat positions row * V + token
    adjust_value: torch.Tensor | None  # float32 [K]
    generator: torch.Generator | None = None  # for unseeded rows; None = torch's default RNG
    row_params: tuple[SamplingParams, ...] = ()  # every row's params, for filter / merge (sampling/running.py)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
        generator: torch.Generator | None = None,
        eos_ids: Iterable[int] = (),
        histories: list[TokenHistory | None] | None = None,
    ) -> SamplingBatch:
        """Gather per-row settings and token counts; ``generator`` serves the rows without a seed;
        ``eos_ids`` are the ids min_new_tokens holds back (with each row's stop_token_ids);
        ``histories``: the rows' running token counts for penalties (penalties.py), when kept."""
        if not len(params) == len(prompt_ids) == len(output_ids):
            raise ValueError(
                f"params, prompt_ids and output_ids differ in length: "
                f"{len(params)}, {len(prompt_ids)}, {len(output_ids)}"
            )
        device = torch.device(device)
        sampled, top_ks = sampled_rows(params, vocab_size)
        sp = [params[i] for i in sampled]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        seeded = [
            (j, _mix_seed(p.sampling_seed, len(output_ids[i])))
            for j, (i, p) in enumerate(zip(sampled, sp, strict=True))
            if p.sampling_seed is not None
        ]
        pen = build_penalties(params, prompt_ids, output_ids, vocab_size, device, eos_ids, histories)
        return cls(
            temperatures=floats([p.temperature for p in sp]),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_ps=floats([p.top_p for p in sp]),
            min_ps=floats([p.min_p for p in sp]),
            seeded=seeded,
            has_penalties=any(v is not None for v in pen.values()),
            generator=generator,
            **pen,
            **row_flags(params, sampled, top_ks, vocab_size, device),
        )


def sampled_rows(params: list[SamplingParams], vocab_size: int) -> tuple[list[int], list[int]]:
    """The rows that sample (not greedy), and their top_k in [1, vocab_size] (vocab_size: off)."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    return sampled, [params[i].top_k if 0 < params[i].top_k < vocab_size else vocab_size for i in sampled]


def row_flags(params: list[SamplingParams], sampled: list[int], top_ks: list[int], vocab_size: int,
              device: torch.device) -> dict:
    """The SamplingBatch fields read from the rows' params on the host (no tensor is read)."""
    sp = [params[i] for i in sampled]
    # top_k needs the k most likely tokens; top_p without top_k starts from a candidate set.
    widths = [k for k in top_ks if k < vocab_size]
    if any(p.top_p < 1.0 and k == vocab_size for p, k in zip(sp, top_ks, strict=True)):
        # On CPU a full sort costs many partial sorts; on a GPU sorting is cheap and avoids a sync.
        widths.append(_TOP_P_CANDIDATES if device.type == "cpu" else vocab_size)
    return {
        "batch_size": len(params),
        "vocab_size": vocab_size,
        "all_greedy": not sampled,
        "sample_rows": None if len(sampled) == len(params) else _rows(sampled, device),
        "need_top_k": any(k < vocab_size for k in top_ks),
        "need_top_p": any(p.top_p < 1.0 for p in sp),
        "need_min_p": any(p.min_p > 0.0 for p in sp),
        "sort_width": min(vocab_size, max(widths, default=vocab_size)),
        "scale_temperature": any(p.temperature != 1.0 for p in sp),
        "row_params": tuple(params),
    }


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # int64 [B]
    # float32 [B]: raw log_softmax (no temperature/penalty/mask) at the token; NaN in rows not in
    # logprob_rows, None when no row asked
    logprobs: torch.Tensor | None
    # Per row, the top-k (logprob, token_id) of the raw log_softmax, k = top_logprobs_nums[row];
    # None when every k is 0.
    top_logprobs: list[list[tuple[float, int]]] | None
    # Per row, (logprob, token_id) of the raw log_softmax at each of the row's `token_ids` ([] for a row
    # without); None when no row asked
    token_ids_logprobs: list[list[tuple[float, int]]] | None = None


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    vocab_mask: torch.Tensor | None = None,
    top_logprobs_nums: list[int] | None = None,
    logprob_rows: list[int] | None = None,
    token_ids: list[list[int] | None] | None = None,
) -> SampleOutput:
    """Choose one token per row. ``logits`` [B, V] is not modified; ``vocab_mask`` is bool [B, V],
    True = allowed, or the grammars' packed int32 bitmask [B, ceil(V / 32)] (constrained/bitmask.py),
    and every row must allow at least one token (a finished grammar allows EOS).
    Logprobs (a log_softmax over the vocabulary) are computed only for ``logprob_rows`` (None: every
    row; []: none), and top logprobs only for those of them with ``top_logprobs_nums`` > 0; ``token_ids``:
    per row, the ids whose logprobs that row reports too (SGLang's token_ids_logprob; rows of logprob_rows)."""
    if tuple(logits.shape) != (batch.batch_size, batch.vocab_size):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} != (batch_size, vocab_size) "
            f"{(batch.batch_size, batch.vocab_size)}"
        )
    packed = vocab_mask is not None and vocab_mask.dtype == torch.int32
    if vocab_mask is not None and vocab_mask.shape != (logits.shape[0], (logits.shape[1] + 31) // 32 if packed
                                                       else logits.shape[1]):
        raise ValueError(f"vocab_mask shape {tuple(vocab_mask.shape)} does not fit logits {tuple(logits.shape)}")
    raw = logits if logits.dtype == torch.float32 else logits.float()
    lp_rows = list(range(raw.shape[0])) if logprob_rows is None else logprob_rows
    raw_logprobs = None
    if lp_rows:  # read before the penalties change raw
        raw_logprobs = torch.log_softmax(raw if logprob_rows is None else raw[lp_rows], dim=-1)

    x = raw
    if batch.has_penalties:
        # raw is no longer needed once log_softmax has read it: penalize it in place if it is ours.
        x = raw.clone(memory_format=torch.contiguous_format) if raw is logits else raw.contiguous()
        apply_penalties_(x, batch)
    next_ids = _choose(x, batch) if vocab_mask is None else _choose_masked(x, batch, vocab_mask, packed)

    if raw_logprobs is None:
        return SampleOutput(next_ids, None, None)
    if logprob_rows is None:
        logprobs = raw_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    else:
        index = torch.tensor(lp_rows, dtype=torch.int64, device=next_ids.device)
        logprobs = torch.full(next_ids.shape, float("nan"), dtype=torch.float32, device=next_ids.device)
        logprobs[index] = raw_logprobs.gather(1, next_ids[index].unsqueeze(1)).squeeze(1)
    top = None
    if top_logprobs_nums is not None and any(top_logprobs_nums[i] for i in lp_rows):
        picked = _top_logprobs_rows(raw_logprobs, [top_logprobs_nums[i] for i in lp_rows])
        top = [[] for _ in range(len(top_logprobs_nums))]
        for i, row in zip(lp_rows, picked):
            top[i] = row
    asked = None
    if token_ids is not None and any(token_ids[i] for i in lp_rows):
        asked = [[] for _ in range(next_ids.shape[0])]
        for j, i in enumerate(lp_rows):
            if token_ids[i]:
                asked[i] = token_logprobs(raw_logprobs[j], token_ids[i])
    return SampleOutput(next_ids, logprobs, top, asked)


def token_logprobs(logprobs: torch.Tensor, token_ids: list[int]) -> list[tuple[float, int]]:
    """(logprob, token_id) of each id in one row of log_softmax values, in the order asked."""
    values = logprobs[torch.tensor(token_ids, dtype=torch.int64, device=logprobs.device)].tolist()
    return list(zip(values, token_ids))


def rows_token_logprobs(logits: torch.Tensor, token_ids: list[int],
                        chunk_rows: int = 256) -> list[list[tuple[float, int]]]:
    """`token_logprobs` of log_softmax(logits) for each row of logits [N, V], a chunk of rows at a
    time (a long prompt's rows never become one [N, V] float32 copy)."""
    index = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    out: list[list[tuple[float, int]]] = []
    for start in range(0, logits.shape[0], chunk_rows):
        x = logits[start : start + chunk_rows].float()
        values = (x.index_select(1, index) - torch.logsumexp(x, dim=-1, keepdim=True)).tolist()
        out += [list(zip(row, token_ids)) for row in values]
    return out


def _choose(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Greedy rows' argmax and sampled rows' draws from the final logits [B, V]."""
    if batch.all_greedy:
        return _argmax(x)
    rows = batch.sample_rows
    drawn = _draw(x if rows is None else x.index_select(0, rows), batch)
    return drawn if rows is None else _argmax(x).index_copy_(0, rows, drawn)


def _choose_masked(x: torch.Tensor, batch: SamplingBatch, mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """_choose over the tokens ``mask`` allows (bool, or packed when ``packed``). The choice is always
    allowed: a row whose allowed tokens all have -inf logits (a -inf bias, an overflowed forward)
    takes its lowest allowed id, as an argmax over them would, so a grammar never sees a token it
    refused."""
    cpu = x.device.type == "cpu" and x.dtype == torch.float32
    if cpu and packed and batch.all_greedy:
        ids = _greedy_masked_cpu(x, mask)
        if ids is not None:
            return ids
    if packed:
        mask = bitmask_to_bool(mask, x.shape[1])
    ids = _choose(_masked_cpu(x, mask), batch) if cpu else None
    inside = None if ids is None else mask.gather(1, ids.unsqueeze(1)).squeeze(1)
    # elsewhere where's own path; on the CPU too when a NaN logit behind the mask was chosen
    if inside is None or not bool(inside.all()):
        ids = _choose(torch.where(mask, x, float("-inf")), batch)
        inside = mask.gather(1, ids.unsqueeze(1)).squeeze(1)
    if not cpu:  # no host sync: every row keeps its choice or takes its first allowed id
        return torch.where(inside, ids, mask.to(torch.uint8).argmax(dim=-1))
    if not bool(inside.all()):
        outside = torch.nonzero(~inside).squeeze(1)
        ids[outside] = mask[outside].to(torch.uint8).argmax(dim=-1)
    return ids


def _masked_cpu(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``torch.where(mask, x, -inf)`` for finite logits, in a scratch buffer of this thread: the mask
    as +inf (allowed) / -inf floats, then an elementwise minimum. On a CPU where's bool path is
    scalar and a fresh [B, V] result faults in its pages every step; these are vectorized passes over
    memory already mapped. A NaN logit stays NaN where where's result has -inf (the caller checks)."""
    out = _scratch(x.shape)
    out.copy_(mask.view(torch.uint8)).sub_(0.5).mul_(float("inf"))
    return torch.minimum(x, out, out=out)


def _greedy_masked_cpu(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor | None:
    """Every row's argmax among the tokens its packed bitmask allows, without masking a row whose
    best token is allowed: no lower id ties with it (argmax takes the lowest), so the masked argmax
    is the same token. Of the others, a row that allows few tokens is read word by word, one that
    refuses few has them knocked out of a copy, and only the rest are masked whole. Masking a [B, V]
    batch costs several passes over it; a grammar usually allows its model's best token, or only a
    few, or nearly all. None when a row chose a token its mask refuses (a NaN logit behind the mask,
    or no allowed logit above -inf): the caller settles those rows."""
    ids = _argmax(x)
    chosen, words = ids.numpy(), bitmask.numpy()  # the bookkeeping of a few rows: numpy, not torch ops
    bad = np.flatnonzero(~allowed(words, chosen))
    if not bad.size:
        return ids
    sub = words[bad]
    few_allowed, few_refused = sparse_rows(sub, x.shape[1])
    if few_allowed.any():
        best = masked_argmax(x.numpy(), sub[few_allowed], bad[few_allowed])
        if best is not None:
            chosen[bad[few_allowed]] = best
            bad, sub, few_refused = bad[~few_allowed], sub[~few_allowed], few_refused[~few_allowed]
    if few_refused.any():
        chosen[bad[few_refused]] = _argmax(refused_out(x, sub[few_refused], bad[few_refused])).numpy()
        bad, sub = bad[~few_refused], sub[~few_refused]
    if bad.size:
        mask = bitmask_to_bool(torch.from_numpy(sub), x.shape[1])
        whole = _masked_cpu(x.index_select(0, torch.from_numpy(bad)), mask)
        chosen[bad] = _argmax(whole).numpy()
    # a row whose allowed tokens are all -inf chose a refused one: the caller settles it
    return ids if allowed(words, chosen).all() else None


_SCRATCH = threading.local()
_SCRATCH_MAX = 16 * 2**20  # floats kept between steps (64 MiB); a larger batch allocates its own


def _scratch(shape: torch.Size) -> torch.Tensor:
    n = shape[0] * shape[1]
    if n > _SCRATCH_MAX:
        return torch.empty(shape, dtype=torch.float32)
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _SCRATCH.buf = torch.empty(n, dtype=torch.float32)
    return buf[:n].view(shape)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """float32 [N]: log_softmax(logits.float())[i, token_ids[i]] (input-token logprobs).

    Works through ``chunk_rows`` rows at a time so a long prompt never holds an [N, V] float32 copy.
    """
    token_ids = token_ids.to(device=logits.device, dtype=torch.int64)
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, logits.shape[0], chunk_rows):
        x = logits[start : start + chunk_rows].float()
        ids = token_ids[start : start + chunk_rows].unsqueeze(1)
        out[start : start + chunk_rows] = (x.gather(1, ids) - torch.logsumexp(x, dim=-1, keepdim=True))[:, 0]
    return out


def top_logprobs(logits: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Per row, the k most likely (logprob, token_id) of log_softmax(logits), most likely first."""
    return _top_logprobs_rows(torch.log_softmax(logits.float(), dim=-1), [k] * logits.shape[0])


# --------------------------------------------------------------------------------------------- helpers


def _top_logprobs_rows(logprobs: torch.Tensor, ks: list[int]) -> list[list[tuple[float, int]]]:
    max_k = min(max(ks), logprobs.shape[1])
    if max_k <= 0:
        return [[] for _ in ks]
    values, ids = torch.topk(logprobs, max_k, dim=-1, sorted=True)
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(values[i][:k], ids[i][:k], strict=True)) for i, k in enumerate(ks)]


def _rows(indices: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.int64, device=device)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _mix_seed(seed: int, step: int) -> int:
    """Generator seed for a request's ``step``-th token: a pure function of (seed, step)."""
    return _splitmix64((_splitmix64(seed) + step) & _MASK64)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax, lowest index on ties (torch.argmax's rule).

    torch.argmax on CPU is not vectorized; amax is. So the CPU path takes the max of every chunk of a
    row (one vectorized pass), the first chunk holding the row's maximum (an argmax over a few hundred
    chunk maxima), and the first maximum inside it (an argmax over one chunk): over ten times faster
    than torch.argmax on a batch of full-vocabulary rows.
    """
    b, v = x.shape
    chunk = _argmax_chunk(v) if x.device.type == "cpu" else 0
    if not chunk:
        return x.argmax(dim=-1)
    n = v // chunk
    chunks = x.reshape(b * n, chunk)
    best = chunks.view(b, n, chunk).amax(dim=-1).argmax(dim=-1)  # [b]: the chunk within each row
    flat = best if b == 1 else best + _row_offsets(b, n)
    return chunks.index_select(0, flat).argmax(dim=-1).add_(best, alpha=chunk)


@functools.lru_cache(maxsize=64)
def _row_offsets(rows: int, chunks: int) -> torch.Tensor:
    """[rows] index of each row's first chunk (CPU only: a cached tensor is never written)."""
    return torch.arange(0, rows * chunks, chunks)


def _argmax_chunk(vocab: int) -> int:
    """The largest of _ARGMAX_CHUNKS that splits a row of `vocab` logits into at least 8 chunks (0: none)."""
    return next((c for c in _ARGMAX_CHUNKS if vocab % c == 0 and vocab >= 8 * c), 0)


def _draw(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Sample one token per row of the penalized, masked logits of the sampled rows [S, V]."""
    if batch.scale_temperature:
        x = x / batch.temperatures.unsqueeze(1)
    probs = torch.softmax(x, dim=-1)
    threshold = None
    if batch.need_top_k or batch.need_top_p:
        threshold = _sorted_threshold(probs, batch)
    if batch.need_min_p:
        floor = probs.amax(dim=-1) * batch.min_ps
        threshold = floor if threshold is None else torch.maximum(threshold, floor)
    if threshold is not None:
        probs.masked_fill_(probs < threshold.unsqueeze(1), 0.0)

    # Inverse CDF in token-id order: the first token whose cumulative mass exceeds u * total.
    # A zero-probability token never raises the cumulative sum, so it can never be that token.
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    ids = torch.searchsorted(cdf, _uniforms(batch, x.shape[0], x.device).unsqueeze(1) * total, right=True)
    # u * total can round up to total; then take the token where the cumulative mass reaches it.
    ids = torch.where(ids >= x.shape[1], torch.searchsorted(cdf, total), ids)
    # A row with no mass (every logit -inf or NaN: a broken forward) would get id V, which the next
    # step's embedding would index out of range for the whole batch: keep it in range instead.
    return ids.squeeze(1).clamp_(max=x.shape[1] - 1)


def _sorted_threshold(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Per-row probability below which top_k / top_p drop a token, [S].

    top_k keeps tokens at least as likely as the k-th most likely one. top_p, applied to the
    top_k-renormalized distribution, keeps the smallest set of most likely tokens whose mass
    reaches top_p. Both are read from the descending values only, so ties and the choice between a
    partial and a full sort cannot change the result.
    """
    vocab = probs.shape[1]
    k, p = batch.top_ks, batch.top_ps
    has_k, has_p = k < vocab, p < 1.0
    width = batch.sort_width
    while True:
        if width < vocab:
            values = torch.topk(probs, width, dim=-1, sorted=True).values
        else:
            values = torch.sort(probs, dim=-1, descending=True).values
        kth = values.gather(1, (k - 1).clamp(max=width - 1).unsqueeze(1)).squeeze(1)
        threshold = torch.where(has_k, kth, 0.0)
        if not batch.need_top_p:
            return threshold
        cums = values.cumsum(dim=-1)
        mass = torch.where(has_k, cums.gather(1, (k - 1).clamp(max=width - 1).unsqueeze(1)).squeeze(1), 1.0)
        # Index of the first token whose cumulative mass reaches top_p of the kept mass.
        last = (cums < (p * mass).unsqueeze(1)).sum(dim=-1)
        if width < vocab and bool((has_p & (last >= width)).any()):
            width = vocab  # the nucleus is wider than the candidates: sort everything
            continue
        nucleus = values.gather(1, last.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
        return torch.maximum(threshold, torch.where(has_p, nucleus, 0.0))


def _uniforms(batch: SamplingBatch, n: int, device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) per sampled row; seeded rows use their own generator."""
    gen = batch.generator
    if gen is None:
        u = torch.rand(n, device=device)
    else:
        u = torch.rand(n, generator=gen, device=gen.device).to(device)
    if batch.seeded:
        # Drawn on the CPU so a seed gives the same numbers on every device.
        seeded = [
            torch.rand((), generator=torch.Generator().manual_seed(s), dtype=torch.float64).item()
            for _, s in batch.seeded
        ]
        index = torch.tensor([j for j, _ in batch.seeded], dtype=torch.int64, device=device)
        u = u.index_copy(0, index, torch.tensor(seeded, dtype=torch.float32, device=device))
    return u
