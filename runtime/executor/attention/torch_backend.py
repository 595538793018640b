"""Reference attention on torch; runs on CPU and CUDA in the model's dtype.

Extend uses `scaled_dot_product_attention` (its fused CPU and CUDA kernels) request by request:
a prompt with no cached prefix attends its own new K/V with `is_causal`, one with a cached prefix
gathers its keys from the pool. SDPA's `is_causal` is top-left aligned, and an explicit mask makes
the fused kernels score every (query, key) pair; so a prefix shorter than the new part is put in
front as zero queries whose outputs are dropped (`is_causal` then skips the upper triangle:
(P + n)^2 / 2 pairs instead of n (P + n)), and a longer prefix takes the bottom-right mask. Decode
is one batched SDPA call over every request's keys (gathered from the req->token table, padded,
masked); on the CPU with a float32 pool, consecutive decodes of the same rows keep those keys
(`decode_kv.OwnKV`) and add each step's new token instead of gathering them all again.

With float32 on the CPU and oneDNN chosen for the model's matmuls (`models/linear.py`), an extend
row with enough (query, key) pairs goes to `cpu_blocked.causal_attention` instead of SDPA: SDPA's
CPU kernel multiplies with MKL, which is half as fast as oneDNN on some CPUs. A model whose matmuls
already take bfloat16 rows (int4 on a CPU with bfloat16 dot products: `set_bf16_extends`) attends
such rows in bfloat16 too, where SDPA's kernel runs on those dot products (about 2.5x float32's on a
long prompt: benchmarks/README.md, "Prefill"); its outputs go back to float32. Behind a shared
prefix they take the cascade below on SDPA's CPU flash kernel, in bfloat16 (`_extend_cascade_bf16`);
without that kernel, row by row, which beats the cascade's float32 products there.

Cascade: when every request of the batch shares a cached prefix (few-shot, fork, n > 1: the radix
cache gives them the very same slots), that prefix is gathered once and scored for all queries of
the batch in one matmul per KV head; each request's own keys are scored separately and the two
partial results are merged by log-sum-exp. Scores are computed in the model's dtype; the softmax
statistics in float32. On the CPU, consecutive decodes keep the prefix's gathered K/V
(`decode_kv.SharedKV`; any extend drops what decodes keep) and score it in one call of SDPA's flash
kernel, which returns the log-sum-exp the merge needs: behind a long shared prompt, regathering,
copying and scoring the prefix head by head would cost a decode step several times the attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.runtime.executor.attention import cpu_blocked, decode_kv
from radixlm.runtime.executor.attention.base import AttentionBackend
from radixlm.runtime.executor.forward_batch import CASCADE_MIN_SHARED, ForwardBatch, ForwardMode

__all__ = ["CASCADE_MIN_SHARED", "TorchAttentionBackend"]


@dataclass(slots=True)
class _KeptOwn:
    """A CPU decode's plan for the rows' own keys kept across steps (decode_kv.OwnKV)."""

    own: decode_kv.OwnKV
    step: int
    index: decode_kv.LazyIndex  # the gather's pool rows, made only if a layer gathers
    new_rows: torch.Tensor  # [B * KVH]: where each row's new token goes (decode_kv.row_starts)


@dataclass(slots=True)
class _DecodeMeta:
    shared: torch.Tensor | None  # [P] slots every request shares, or None
    kv_index: torch.Tensor | None  # [B, L] slots of each request's keys after the shared prefix (padded)
    mask: torch.Tensor  # [B, 1, 1, L] True where the key is real
    kept: _KeptOwn | None = None  # instead of kv_index: the own keys kept from the last step


@dataclass(slots=True)
class _ExtendMeta:
    qo: list[int]  # host qo_indptr
    kv: list[int]  # host kv_indptr
    shared: torch.Tensor | None  # [P] slots every request shares, or None
    # per request: None = plain causal over its new K/V; an int k = k zero queries in front, then
    # causal over all its keys; a tensor = [n, L - P] bottom-right causal mask (the bfloat16 cascade's:
    # [n * G, L - P], additive); BLOCKED = the oneDNN blocked kernel (cpu_blocked.py) over all its keys
    masks: list[torch.Tensor | int | str | None]
    singles: _SingleRows | None  # one-token rows with a cached prefix, attended in one batched call
    batched: frozenset[int]  # their positions in the batch (skipped by the per-request loop)


@dataclass(slots=True)
class _SingleRows:
    """Decode rows riding along in an extend pass (jump-forward, mixed batches): one SDPA call for
    all of them instead of one per row and layer."""

    index: list[int]  # their positions in the batch
    q_index: torch.Tensor  # [S] their query rows in the flat batch
    decode: _DecodeMeta


BLOCKED = "blocked"
BF16_MIN_PAIRS = 128 * 128  # (query, key) pairs from which a bfloat16 extend beats float32 plus the casts
# SDPA's CPU kernel with its log-sum-exp (a build without it scores the kept prefix with `_partial`)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_graphs = True
    # a captured decode attends the table's full width, an eager one the batch's longest row: softmax
    # and P@V sum over other lengths, so the bits differ (an H100 turned a near tie at batch 24)
    graph_exact = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.gqa = num_heads != num_kv_heads
        self._graph_index: torch.Tensor | None = None
        self._graph_mask: torch.Tensor | None = None
        self.onednn = False  # the cascade's products on oneDNN matmuls (float32 CPU only)
        self.blocked = False  # extend attention of long rows on cpu_blocked, where it beats SDPA here
        self.bf16_extends = False  # extend attention of long rows in bfloat16 (set_bf16_extends)
        # what consecutive CPU decodes keep of their gathers (decode_kv.py); any extend drops both
        self._shared_kv: decode_kv.SharedKV | None = None  # the shared prefix's K/V
        self._own_kv: decode_kv.OwnKV | None = None  # each row's keys after it
        self._step = 0  # decodes planned with kept own keys

    def set_gemm(self, gemm: str) -> None:
        self.onednn = gemm == "onednn"
        self.blocked = self.onednn and cpu_blocked.beats_sdpa(self.num_heads, self.num_kv_heads, self.head_dim)

    def set_bf16_extends(self, on: bool) -> None:
        """Long extend rows attend in bfloat16 (a model whose matmuls round their rows to bfloat16)."""
        self.bf16_extends = on

    # ---------------------------------------------------------------- planning
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        p = batch.shared_prefix_len
        # the first request's leading slots (every request holds the same ones); not kv_indices,
        # which a decode step would otherwise build just for this
        shared = batch.req_to_token[batch.req_rows[:1], :p].view(-1) if p else None
        if batch.mode is ForwardMode.DECODE:
            cpu, kept = batch.req_to_token.device.type == "cpu", self._shared_kv
            if shared is None or not cpu:  # no copies beside a GPU's pool
                self._shared_kv = None
            else:
                if kept is None or not kept.matches(batch.kv_pool, shared):
                    kept = self._shared_kv = decode_kv.SharedKV(batch.kv_pool, shared, {})
                shared = kept.index  # the same slots; forward_decode finds the kept K/V by this tensor
            width = max(batch.seq_lens_host) - p
            if cpu and batch.kv_pool.k[0].dtype == torch.float32:
                batch.attn_metadata = self._keep_own(batch, shared, p, width)
                return
            kv_index, mask = _key_table(batch.req_to_token, batch.req_rows, batch.seq_lens, p, width)
            batch.attn_metadata = _DecodeMeta(shared, kv_index, mask)
            return
        self._shared_kv = self._own_kv = None  # an extend may write slots that later decodes read (decode_kv.py)
        if p and self.bf16_extends and _FLASH_CPU is None:
            p, shared = 0, None  # each row on SDPA's bfloat16 kernel beats the cascade's float32 products
        qo = [0]
        for n in batch.extend_lens_host:
            qo.append(qo[-1] + n)
        kv = [0]
        for n in batch.seq_lens_host:
            kv.append(kv[-1] + n)
        masks: list[torch.Tensor | int | str | None] = []
        device = batch.input_ids.device
        singles = None if p else _single_rows(batch, qo)
        batched = frozenset(singles.index if singles else ())
        for i, (n_new, n_all) in enumerate(zip(batch.extend_lens_host, batch.seq_lens_host)):
            if i in batched:
                masks.append(None)
                continue
            if self.blocked and not self.bf16_extends and not p and cpu_blocked.worth_it(n_new, n_all):
                masks.append(BLOCKED)
                continue
            if n_new == n_all and not p:
                masks.append(None)
                continue
            if not p and n_all - n_new < n_new:  # padded causal scores fewer pairs than the mask
                masks.append(n_all - n_new)
                continue
            # query i (absolute position n_all - n_new + i) sees keys at positions <= its own
            q_pos = torch.arange(n_all - n_new, n_all, device=device)[:, None]
            k_pos = torch.arange(p, n_all, device=device)[None, :]
            masks.append(k_pos <= q_pos)
        if p and self.bf16_extends:  # the flash kernel's mask: additive, in the queries' dtype, a row per query head
            g = self.num_heads // self.num_kv_heads
            masks = [torch.zeros(m.shape[0] * g, m.shape[1], dtype=torch.bfloat16, device=device)
                     .masked_fill_(~m.repeat_interleave(g, 0), float("-inf")) for m in masks]
        batch.attn_metadata = _ExtendMeta(qo, kv, shared, masks, singles, batched)

    def _keep_own(self, batch: ForwardBatch, shared: torch.Tensor | None, p: int, width: int) -> _DecodeMeta:
        """The plan of a decode whose rows' own keys (positions p to p + width, padded to a block) are
        kept from step to step, each step adding its new token's K/V instead of gathering them all."""
        b, kvh = batch.batch_size, batch.kv_pool.k[0].shape[1]
        width = decode_kv.padded(width)
        own = self._own_kv
        if own is None or not own.matches(batch.kv_pool, batch.req_rows, p, width):
            own = self._own_kv = decode_kv.OwnKV(batch.kv_pool, batch.req_rows.clone(), p, width, {})
        self._step += 1
        lens = batch.seq_lens - p
        mask = (torch.arange(width) < lens[:, None]).view(b, 1, 1, width)
        new_rows = decode_kv.row_starts(b, kvh, width).add_((lens - 1)[:, None]).view(-1)
        index = decode_kv.LazyIndex(batch.req_to_token, batch.req_rows, p + width, p, kvh)
        return _DecodeMeta(shared, None, mask, _KeptOwn(own, self._step, index, new_rows))

    # ---------------------------------------------------------------- decode
    def forward_decode(self, q, k, v, layer, batch):
        meta: _DecodeMeta = batch.attn_metadata
        pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        plan = meta.kept
        if plan is None:
            keys, values = self._own_keys(pool_k, pool_v, meta)
        else:
            b, kvh, d = meta.mask.shape[0], pool_k.shape[1], pool_k.shape[2]
            own = plan.own.get(batch.kv_pool, layer, plan.step, plan.index, kvh, plan.new_rows,
                               k.view(b, kvh, d), v.view(b, kvh, d))
            keys, values = own.keys.view(b, kvh, -1, d), own.values.view(b, kvh, -1, d)
        if meta.shared is None:
            return self._decode(q, keys, values, meta.mask)
        kept = self._shared_kv
        if kept is not None and kept.index is meta.shared:
            sk, sv = kept.get(layer, _shared_layout)
        else:  # kept only on the CPU (init_forward_metadata)
            sk, sv = _shared_layout(batch.kv_pool, layer, meta.shared)
        return self._decode_cascade(q, keys, values, meta.mask, sk, sv)

    def _own_keys(self, pool_k, pool_v, meta: _DecodeMeta):
        """Each row's keys and values after the shared prefix, [B, KVH, L, D] (padded; `meta.mask`)."""
        b, n = meta.kv_index.shape
        kvh, d = pool_k.shape[1], pool_k.shape[2]
        flat = meta.kv_index.reshape(-1)
        keys = pool_k.index_select(0, flat).view(b, n, kvh, d).transpose(1, 2)
        return keys, pool_v.index_select(0, flat).view(b, n, kvh, d).transpose(1, 2)

    def _decode(self, q, keys, values, mask):
        """One query per row over its keys and values [B, KVH, L, D] where `mask` [B, 1, 1, L] is True."""
        b, d = keys.shape[0], keys.shape[-1]
        out = F.scaled_dot_product_attention(
            q.view(b, self.num_heads, 1, d), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=self.gqa,
        )
        return out.view(b, self.num_heads, d)

    def _decode_cascade(self, q, keys, values, mask, sk: torch.Tensor, sv: torch.Tensor):
        """`_decode` behind a shared prefix whose K/V are `sk`, `sv` [1, KVH, P, D] (`_shared_layout`)."""
        b, kvh, d = keys.shape[0], keys.shape[1], keys.shape[-1]
        qg = q.view(b, kvh, -1, d)  # [B, KVH, G, D]: heads sharing a KV head together
        g = qg.shape[2]
        part = _partial(qg * self.scale, keys, values, mask)
        if _FLASH_CPU is not None and q.device.type == "cpu":
            # all B * G queries of a KV head in one call; its output is normalized: sum 1 at max `lse`
            o, lse = _FLASH_CPU(qg.permute(1, 0, 2, 3).reshape(1, kvh, b * g, d), sk, sv, 0.0, False, scale=self.scale)
            lse = lse.view(kvh, b, g, 1).transpose(0, 1)
            shared = (o.view(kvh, b, g, d).transpose(0, 1).float(), lse, torch.ones_like(lse))
        else:
            shared = tuple(x.transpose(0, 1) for x in _partial(qg.transpose(0, 1) * self.scale, sk[0], sv[0], None))
        out, _, den = _merge(part, shared)
        return (out / den).reshape(b, self.num_heads, d).to(q.dtype)

    # ---------------------------------------------------------------- extend
    def forward_extend(self, q, k, v, layer, batch):
        meta: _ExtendMeta = batch.attn_metadata
        if meta.shared is not None:
            if self.bf16_extends:
                return self._extend_cascade_bf16(q, layer, batch)
            return self._extend_cascade(q, layer, batch)
        pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        out = torch.empty_like(q)
        if meta.singles is not None:
            rows = meta.singles
            keys, values = self._own_keys(pool_k, pool_v, rows.decode)
            out[rows.q_index] = self._decode(q.index_select(0, rows.q_index), keys, values, rows.decode.mask)
        for i, mask in enumerate(meta.masks):
            if i in meta.batched:
                continue
            s, e = meta.qo[i], meta.qo[i + 1]
            if meta.kv[i + 1] - meta.kv[i] == e - s:  # no cached prefix: the new K/V are all the keys
                ki, vi = k[s:e], v[s:e]
            else:
                idx = batch.kv_indices[meta.kv[i] : meta.kv[i + 1]]
                ki, vi = pool_k.index_select(0, idx), pool_v.index_select(0, idx)
            if mask is BLOCKED:
                out[s:e] = cpu_blocked.causal_attention(q[s:e], ki, vi, self.scale)
                continue
            qi = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if self.bf16_extends and (e - s) * ki.shape[0] >= BF16_MIN_PAIRS:
                qi, ki, vi = qi.bfloat16(), ki.bfloat16(), vi.bfloat16()
            pad = mask if isinstance(mask, int) else 0
            if pad:
                qi = torch.cat([qi.new_zeros(1, qi.shape[1], pad, qi.shape[3]), qi], dim=2)
            o = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask if isinstance(mask, torch.Tensor) else None,
                is_causal=not isinstance(mask, torch.Tensor), scale=self.scale, enable_gqa=self.gqa,
            )
            out[s:e] = o[0, :, pad:].transpose(0, 1)
        return out

    def _extend_cascade(self, q, layer, batch):
        meta: _ExtendMeta = batch.attn_metadata
        pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        kvh, d = pool_k.shape[1], pool_k.shape[2]
        qg = (q * self.scale).view(q.shape[0], kvh, -1, d).permute(1, 2, 0, 3)  # [KVH, G, T, D]
        sk, sv = _gather_kv(pool_k, pool_v, meta.shared)
        shared = _partial(qg, sk, sv, None, self.onednn)
        skip = meta.shared.numel()
        out = torch.empty_like(q)
        for i, mask in enumerate(meta.masks):
            s, e = meta.qo[i], meta.qo[i + 1]
            keys, values = _gather_kv(pool_k, pool_v, batch.kv_indices[meta.kv[i] + skip : meta.kv[i + 1]])
            part = _merge(_partial(qg[:, :, s:e], keys, values, mask, self.onednn),
                          tuple(x[:, :, s:e] for x in shared))
            o, _, den = part
            out[s:e] = (o / den).permute(2, 0, 1, 3).reshape(e - s, self.num_heads, d).to(q.dtype)
        return out

    def _extend_cascade_bf16(self, q, layer, batch):
        """`_extend_cascade` in bfloat16 on SDPA's CPU flash kernel: every query of the batch over the
        shared prefix in one call per step and layer (the G query heads of a KV head folded into its
        rows), each request's queries over its own keys in another, merged by their log-sum-exps."""
        meta: _ExtendMeta = batch.attn_metadata
        pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        t, kvh, d = q.shape[0], pool_k.shape[1], pool_k.shape[2]
        g = self.num_heads // kvh

        def folded(rows: torch.Tensor) -> torch.Tensor:  # [n, H, D] -> [1, KVH, n * G, D], bfloat16
            return rows.to(torch.bfloat16).view(-1, kvh, g, d).transpose(0, 1).reshape(1, kvh, -1, d)

        def kv(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [1, KVH, L, D], bfloat16
            k, v = (x.index_select(0, slots).to(torch.bfloat16).transpose(0, 1).unsqueeze(0) for x in (pool_k, pool_v))
            return k, v

        o, lse = _FLASH_CPU(folded(q), *kv(meta.shared), 0.0, False, scale=self.scale)
        shared_o, shared_lse = o.view(kvh, t, g, d), lse.view(kvh, t, g, 1)
        skip = meta.shared.numel()
        out = torch.empty_like(q)
        for i, bias in enumerate(meta.masks):
            s, e = meta.qo[i], meta.qo[i + 1]
            own_k, own_v = kv(batch.kv_indices[meta.kv[i] + skip : meta.kv[i + 1]])
            o, lse = _FLASH_CPU(folded(q[s:e]), own_k, own_v, 0.0, False, attn_mask=bias, scale=self.scale)
            # each part's output is normalized: its weight in the merge is 1 at its log-sum-exp
            own_lse, prefix_lse = lse.view(kvh, e - s, g, 1), shared_lse[:, s:e]
            merged, _, den = _merge((o.view(kvh, e - s, g, d).float(), own_lse, 1.0),
                                    (shared_o[:, s:e].float(), prefix_lse, 1.0))
            out[s:e] = (merged / den).permute(1, 0, 2, 3).reshape(e - s, self.num_heads, d).to(q.dtype)
        return out

    # ---------------------------------------------------------------- CUDA-graph hooks
    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        # every captured decode attends the table's full width; masks hide what is not real
        self._graph_index = torch.zeros((max_bs, max_context), dtype=torch.int64, device=device)
        self._graph_mask = torch.zeros((max_bs, 1, 1, max_context), dtype=torch.bool, device=device)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        if self._graph_index is None:
            raise RuntimeError("init_graph_state must run before capture/replay")
        self._own_kv = None  # a replayed decode writes tokens that kept own keys would miss
        bs, width = batch.batch_size, self._graph_index.shape[1]
        index, mask = self._graph_index[:bs], self._graph_mask[:bs]
        new_index, new_mask = _key_table(batch.req_to_token, batch.req_rows, batch.seq_lens, 0, width)
        index.copy_(new_index)
        mask.copy_(new_mask)
        batch.attn_metadata = _DecodeMeta(None, index, mask)


def _single_rows(batch: ForwardBatch, qo: list[int]) -> _SingleRows | None:
    index = [i for i, (n_new, n_all) in enumerate(zip(batch.extend_lens_host, batch.seq_lens_host))
             if n_new == 1 and n_all > 1]
    if len(index) < 2:
        return None
    device = batch.input_ids.device
    picked = torch.tensor(index + [qo[i] for i in index], dtype=torch.int64, device=device)  # one copy
    rows, q_index = picked[: len(index)], picked[len(index):]
    width = max(batch.seq_lens_host[i] for i in index)
    kv_index, mask = _key_table(batch.req_to_token, batch.req_rows.index_select(0, rows),
                                batch.seq_lens.index_select(0, rows), 0, width)
    return _SingleRows(index, q_index, _DecodeMeta(None, kv_index, mask))


def _key_table(table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, start: int, width: int):
    """One query per row over its keys at positions [start, start + width): their slots [B, width]
    (padded with whatever the table holds) and the mask [B, 1, 1, width] of the real ones."""
    cols = torch.arange(start, start + width, device=table.device)
    mask = (cols[None, :] < seq_lens[:, None]).view(rows.numel(), 1, 1, width)
    return table[rows, start : start + width], mask


def _shared_layout(pool, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `slots` as dense [1, KVH, P, D]: what a decode keeps of a shared prefix (SharedKV)."""
    return tuple(t[layer].index_select(0, slots).transpose(0, 1).unsqueeze(0).contiguous() for t in (pool.k, pool.v))


def _gather_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor):
    """K and V as [KVH, L, D] for the given slots."""
    return pool_k.index_select(0, slots).transpose(0, 1), pool_v.index_select(0, slots).transpose(0, 1)


def _partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
             onednn: bool = False):
    """Attention over one block of keys: (unnormalized output, row max, row sum of exp), float32.

    q [..., Q, D] (pre-scaled), keys and values [..., L, D], mask broadcastable to [..., Q, L]
    (True = visible). Every query must see at least one key of the block. With 3-D keys [KVH, L, D]
    shared by a 4-D q [KVH, X, Q, D], X is folded into the query rows: one matmul per KV head
    instead of matmul broadcasting (copying) the keys X times; on oneDNN (`onednn`) those matmuls
    run head by head (see cpu_blocked.py for why).
    """
    fold = q.dim() == 4 and keys.dim() == 3
    if fold and onednn:
        return _partial_onednn(q, keys, values, mask)
    lead = q.shape[:-1]
    if fold:
        q = q.reshape(q.shape[0], -1, q.shape[-1])
    scores = torch.matmul(q, keys.transpose(-1, -2)).float()
    if fold:
        scores = scores.view(*lead, scores.shape[-1])
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    pv = p.to(values.dtype)
    if fold:
        out = torch.matmul(pv.view(pv.shape[0], -1, pv.shape[-1]), values).view(*lead, values.shape[-1])
    else:
        out = torch.matmul(pv, values)
    return out.float(), m, p.sum(-1, keepdim=True)


def _partial_onednn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None):
    """`_partial`'s folded case (q [KVH, X, Q, D], keys/values [KVH, L, D]) on oneDNN, float32 only."""
    kvh, x, n, d = q.shape
    keys = keys.contiguous()  # oneDNN's weight operand must be dense
    outs, maxes, sums = [], [], []
    for h in range(kvh):
        scores = cpu_blocked.onednn_matmul(q[h].reshape(x * n, d), keys[h]).view(x, n, -1)
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        m = scores.amax(-1, keepdim=True)
        p = scores.sub_(m).exp_()
        outs.append(cpu_blocked.onednn_matmul_pv(p.view(x * n, -1), values[h]).view(x, n, d))
        maxes.append(m)
        sums.append(p.sum(-1, keepdim=True))
    return torch.stack(outs), torch.stack(maxes), torch.stack(sums)


def _merge(a, b):
    """Combine two partial attentions over disjoint key blocks (log-sum-exp rescaling)."""
    out_a, m_a, den_a = a
    out_b, m_b, den_b = b
    m = torch.maximum(m_a, m_b)
    wa, wb = torch.exp(m_a - m), torch.exp(m_b - m)
    return out_a * wa + out_b * wb, m, den_a * wa + den_b * wb
