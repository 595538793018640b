"""Reference attention on torch SDPA; runs on CPU and CUDA.

Decode gathers every request's K/V into one padded [B, KVH, L, D] block and attends with batched
matmuls. When the whole batch shares a cached prefix (few-shot, fork, n > 1: the radix cache
gives them the very same slots) that prefix is gathered and scored once for all queries
(cascade attention) and merged with each request's own suffix by log-sum-exp, instead of being
copied B times. Extend runs one SDPA call per request (ragged lengths, causal with a
cached-prefix offset), which avoids the quadratic waste of one block-diagonal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.attention.base import AttentionBackend
from radixlm.runtime.forward_batch import ForwardBatch

CASCADE_MIN_SHARED = 64  # shared-prefix tokens from which one shared pass beats B gathers


@dataclass(slots=True)
class _DecodeMeta:
    shared: torch.Tensor | None  # [P] slots of the prefix every request shares, or None
    kv_index: torch.Tensor  # [B, L] slot ids after the shared prefix, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L] True where the key is real


@dataclass(slots=True)
class _ExtendMeta:
    q_starts: list[int]
    shared: torch.Tensor | None  # [P] slots of a cached prefix every request shares, or None
    masks: list[torch.Tensor]  # per request [q_len, kv_len - P], causal with the prefix offset


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.gqa = num_heads != num_kv_heads

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        if batch.mode.value == "decode":
            batch.attn_metadata = self._decode_metadata(batch.kv_indices, device)
            return
        shared_len = 0
        if batch.batch_size > 1:
            cached = [n_all - n_new for n_new, n_all in zip(batch.extend_lens, batch.seq_lens)]
            shared_len = min(_common_prefix_len(batch.kv_indices), min(cached))
        if shared_len < CASCADE_MIN_SHARED:
            shared_len = 0
        q_starts, masks, start = [], [], 0
        for n_new, n_all in zip(batch.extend_lens, batch.seq_lens):
            q_starts.append(start)
            start += n_new
            # query i (absolute position n_all - n_new + i) sees keys at positions <= its own
            q_pos = torch.arange(n_all - n_new, n_all, device=device)[:, None]
            k_pos = torch.arange(shared_len, n_all, device=device)[None, :]
            masks.append(k_pos <= q_pos)
        shared = batch.kv_indices[0][:shared_len] if shared_len else None
        batch.attn_metadata = _ExtendMeta(q_starts, shared, masks)

    def _decode_metadata(self, kv_indices: list[torch.Tensor], device) -> _DecodeMeta:
        shared_len = _common_prefix_len(kv_indices) if len(kv_indices) > 1 else 0
        if shared_len < CASCADE_MIN_SHARED:
            shared_len = 0
        rest = [idx[shared_len:] for idx in kv_indices]
        max_len = max(int(r.numel()) for r in rest)
        kv_index = torch.zeros((len(rest), max_len), dtype=torch.int64, device=device)
        mask = torch.zeros((len(rest), 1, 1, max_len), dtype=torch.bool, device=device)
        for i, r in enumerate(rest):
            kv_index[i, : r.numel()] = r
            mask[i, ..., : r.numel()] = True
        shared = kv_indices[0][:shared_len] if shared_len else None
        return _DecodeMeta(shared, kv_index, mask)

    def forward_decode(self, q, k, v, layer, batch):
        meta: _DecodeMeta = batch.attn_metadata
        pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        b, n = meta.kv_index.shape
        kvh, d = pool_k.shape[1], pool_k.shape[2]
        qg = q.view(b, kvh, -1, d).float() * self.scale  # [B, KVH, G, D]: heads sharing a KV head together
        flat = meta.kv_index.view(-1)
        keys = pool_k.index_select(0, flat).view(b, n, kvh, d).permute(0, 2, 3, 1)  # [B, KVH, D, L]
        values = pool_v.index_select(0, flat).view(b, n, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
        part = _partial(qg, keys, values, meta.mask)
        if meta.shared is not None:
            # one pass over the shared prefix for all B * H queries
            sk, sv = _gather_kv(pool_k, pool_v, meta.shared)
            shared = _partial(qg.transpose(0, 1), sk, sv, None)  # [KVH, B, G, .]
            part = _merge(part, tuple(x.transpose(0, 1) for x in shared))
        out, _, den = part
        return (out / den).reshape(b, self.num_heads, d).to(q.dtype)

    def forward_extend(self, q, k, v, layer, batch):
        meta: _ExtendMeta = batch.attn_metadata
        pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        kvh, d = pool_k.shape[1], pool_k.shape[2]
        qg = q.view(q.shape[0], kvh, -1, d).permute(1, 2, 0, 3).float() * self.scale  # [KVH, G, T, D]
        shared = None
        if meta.shared is not None:
            sk, sv = _gather_kv(pool_k, pool_v, meta.shared)
            shared = _partial(qg, sk, sv, None)
        out = torch.empty_like(q)
        skip = 0 if meta.shared is None else meta.shared.numel()
        for i, idx in enumerate(batch.kv_indices):
            s, n = meta.q_starts[i], batch.extend_lens[i]
            keys, values = _gather_kv(pool_k, pool_v, idx[skip:])
            part = _partial(qg[:, :, s : s + n], keys, values, meta.masks[i])
            if shared is not None:
                part = _merge(part, tuple(x[:, :, s : s + n] for x in shared))
            o, _, den = part
            out[s : s + n] = (o / den).permute(2, 0, 1, 3).reshape(n, self.num_heads, d).to(q.dtype)
        return out


def _gather_kv(pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor):
    """K as [KVH, D, L] and V as [KVH, L, D] for the given slots."""
    return pool_k.index_select(0, slots).permute(1, 2, 0), pool_v.index_select(0, slots).transpose(0, 1)


def _partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None):
    """Attention over one block of keys: (unnormalized output, row max, row sum of exp).

    q [..., Q, D] (pre-scaled), keys [..., D, L], values [..., L, D], mask broadcastable to
    [..., Q, L] (True = visible). Every query must see at least one key of the block. With 3-D
    keys [KVH, D, L] shared by a 4-D q [KVH, X, Q, D], X is folded into the query rows: one matmul
    per KV head instead of matmul broadcasting (copying) the keys X times.
    """
    fold = q.dim() == 4 and keys.dim() == 3
    lead = q.shape[:-1]
    if fold:
        q = q.reshape(q.shape[0], -1, q.shape[-1])
    scores = torch.matmul(q, keys.float())
    if fold:
        scores = scores.view(*lead, scores.shape[-1])
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    if fold:
        out = torch.matmul(p.view(p.shape[0], -1, p.shape[-1]), values.float()).view(*lead, values.shape[-1])
    else:
        out = torch.matmul(p, values.float())
    return out, m, p.sum(-1, keepdim=True)


def _merge(a, b):
    """Combine two partial attentions over disjoint key blocks (log-sum-exp rescaling)."""
    out_a, m_a, den_a = a
    out_b, m_b, den_b = b
    m = torch.maximum(m_a, m_b)
    wa, wb = torch.exp(m_a - m), torch.exp(m_b - m)
    return out_a * wa + out_b * wb, m, den_a * wa + den_b * wb


def _common_prefix_len(indices: list[torch.Tensor]) -> int:
    """Length of the slot prefix all requests share (they share slots exactly when they share tokens
    through the radix cache)."""
    n = min(int(x.numel()) for x in indices) - 1  # the last slot (current token) is never shared
    first = indices[0][:n]
    for other in indices[1:]:
        if n <= 0:
            return 0
        diff = (other[:n] != first[:n]).nonzero()
        if diff.numel():
            n = int(diff[0, 0])
    return max(n, 0)
