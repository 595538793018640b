"""Reference attention on torch SDPA; runs on CPU and CUDA.

Decode gathers every request's K/V into one padded [B, KVH, L, D] block and runs a single SDPA
call; extend runs one SDPA call per request (ragged lengths, causal with a cached-prefix offset),
which avoids the quadratic waste of one block-diagonal mask over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixlm.runtime.attention.base import AttentionBackend
from radixlm.runtime.forward_batch import ForwardBatch


@dataclass(slots=True)
class _DecodeMeta:
    kv_index: torch.Tensor  # [B, L] slot ids, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L] True where the key is real


@dataclass(slots=True)
class _ExtendMeta:
    q_starts: list[int]
    masks: list[torch.Tensor | None]  # per request [q_len, kv_len] or None when q_len == 1


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
            max_len = max(batch.seq_lens)
            kv_index = torch.zeros((batch.batch_size, max_len), dtype=torch.int64, device=device)
            mask = torch.zeros((batch.batch_size, 1, 1, max_len), dtype=torch.bool, device=device)
            for i, (idx, n) in enumerate(zip(batch.kv_indices, batch.seq_lens)):
                kv_index[i, :n] = idx
                mask[i, ..., :n] = True
            batch.attn_metadata = _DecodeMeta(kv_index, mask)
            return
        q_starts, masks, start = [], [], 0
        for n_new, n_all in zip(batch.extend_lens, batch.seq_lens):
            q_starts.append(start)
            start += n_new
            if n_new == 1:
                masks.append(None)
                continue
            # query i (absolute position n_all - n_new + i) sees keys at positions <= its own
            q_pos = torch.arange(n_all - n_new, n_all, device=device)[:, None]
            k_pos = torch.arange(n_all, device=device)[None, :]
            masks.append(k_pos <= q_pos)
        batch.attn_metadata = _ExtendMeta(q_starts, masks)

    def forward_decode(self, q, k, v, layer, batch):
        meta: _DecodeMeta = batch.attn_metadata
        b, n = meta.kv_index.shape
        flat = meta.kv_index.view(-1)
        pool_k, pool_v = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        keys = pool_k.index_select(0, flat).view(b, n, *pool_k.shape[1:]).transpose(1, 2)  # [B, KVH, L, D]
        values = pool_v.index_select(0, flat).view(b, n, *pool_v.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=meta.mask, scale=self.scale, enable_gqa=self.gqa
        )  # [B, H, 1, D]
        return out.squeeze(2)

    def forward_extend(self, q, k, v, layer, batch):
        meta: _ExtendMeta = batch.attn_metadata
        out = torch.empty_like(q)
        k_pool, v_pool = batch.kv_pool.k[layer], batch.kv_pool.v[layer]
        for i, idx in enumerate(batch.kv_indices):
            s, n = meta.q_starts[i], batch.extend_lens[i]
            keys = k_pool.index_select(0, idx).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            values = v_pool.index_select(0, idx).transpose(0, 1).unsqueeze(0)
            qi = q[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            oi = F.scaled_dot_product_attention(
                qi, keys, values, attn_mask=meta.masks[i], scale=self.scale, enable_gqa=self.gqa
            )
            out[s : s + n] = oi[0].transpose(0, 1)
        return out
