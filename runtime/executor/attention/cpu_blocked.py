"""Causal attention of one request's new tokens on oneDNN matmuls (CPU, float32).

SDPA's fused CPU kernel computes its score and value products with MKL's sgemm, the same kernel
that runs at half speed on the CPUs `models/linear.py` describes, where it is a large share of a
long prefill. Here the queries go in blocks of `BLOCK` tokens: a block's scores against
every key it may see are one oneDNN product per KV head (the G query heads sharing that KV head are
stacked as rows, so GQA costs no copies of K/V), the causal mask touches only the block's diagonal
square, then softmax and the value product. A cached prefix costs nothing extra: a block simply sees
the prefix keys too (no padding queries, no mask over the prefix).

Only used where it wins: float32 on the CPU with oneDNN chosen, SDPA slower on this CPU
(`beats_sdpa`: which is faster depends on the CPU; on some SDPA's own kernel is), and enough work
per call (`worth_it`) for its per-block calls to pay off against SDPA's single call.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F

from radixlm.runtime.executor.models.linear import onednn_linear

BLOCK = 128  # query tokens per block: larger wastes more of the diagonal square, smaller calls more often
MIN_PAIRS = 256 * 256  # (query, key) pairs below which SDPA's single call is about as fast or faster


def onednn_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, D] @ b[N, D]^T on oneDNN; b must be contiguous (a strided weight operand is ~1000x slower)."""
    return onednn_linear(a, b, None)


def onednn_matmul_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [M, L] @ v [L, D] as (v^T p^T)^T: v^T is a strided view, fine as oneDNN's data operand."""
    return onednn_linear(v.t(), p, None).t()


@functools.cache
def beats_sdpa(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether this kernel is faster than SDPA's on this CPU for a 1,024-token prompt of the model's
    shape, timed once per process at load (best of three each, ~0.1 s)."""
    gen = torch.Generator().manual_seed(0)
    n = 1024
    q, k, v = (torch.randn(n, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    scale = head_dim**-0.5

    def sdpa() -> torch.Tensor:  # [1, H, n, D] as the backend calls it (without the batch dimension it is slower)
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                              enable_gqa=heads != kv_heads)

    def best(run) -> float:
        run()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    return best(lambda: causal_attention(q, k, v, scale)) < best(sdpa)


def worth_it(n_new: int, n_all: int) -> bool:
    return n_new * n_all >= MIN_PAIRS and n_new > 1


@functools.lru_cache(maxsize=8)
def _diagonal_mask(b: int, groups: int) -> torch.Tensor:
    """[b, G, b]: True where key j of the block is after query token t (hidden)."""
    return torch.ones(b, b, dtype=torch.bool).triu_(1)[:, None, :].expand(b, groups, b)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D]: the request's new tokens, at the last n positions; k/v [L, KVH, D]: all its
    keys (the cached prefix, then the new ones). Returns [n, H, D]."""
    n, heads, d = q.shape
    kv_heads, prefix = k.shape[1], k.shape[0] - n
    groups = heads // kv_heads
    # query heads sharing a KV head as consecutive rows: [KVH, n, G, D]
    qg = torch.empty(kv_heads, n, groups, d, dtype=q.dtype)
    torch.mul(q.view(n, kv_heads, groups, d).transpose(0, 1), scale, out=qg)
    kh = k.transpose(0, 1).contiguous()  # [KVH, L, D]
    vh = v.transpose(0, 1).contiguous()
    out = torch.empty(n, kv_heads, groups, d, dtype=q.dtype)
    for start in range(0, n, BLOCK):
        end = min(n, start + BLOCK)
        b, seen = end - start, prefix + end
        mask = _diagonal_mask(b, groups)
        for h in range(kv_heads):
            scores = onednn_matmul(qg[h, start:end].reshape(b * groups, d), kh[h, :seen])
            scores.view(b, groups, seen)[:, :, prefix + start :].masked_fill_(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start:end, h] = onednn_matmul_pv(probs, vh[h, :seen]).view(b, groups, d)
    return out.view(n, heads, d)
