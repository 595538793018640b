"""Triton kernels of the `triton` attention backend, over the page-size-1 KV pool, and their launchers.

Decode (one query token per request) is flash-decoding: program (request, KV head, split) reads its
share of the request's keys (slots from the req->token table, one token per slot, anywhere in the
pool) and keeps an online softmax for the G query heads of that KV head at once (they are the rows
of one matrix product, so each K/V block is loaded once for all of them). With one split the
program writes the output itself; with several, each writes its normalized partial output and
log-sum-exp, and a second kernel merges the splits of a (request, head).

A request's splits follow its own key count alone (`chunk`: at least SPLIT_LEN keys, whole key
blocks, at most MAX_SPLITS of them), never the grid, the batch or the length bound, and the merge
adds the real splits one after another in their order: so a request gets the same bits in any
batch, eager or replayed from a graph bucket planned for the longest context (extra programs of a
larger grid exit without writing). The cascade's query blocks are always SHARED_BLOCK_M rows for
the same reason.

Cascade decode: when every request of the batch holds the same leading slots (a few-shot prompt, a
fork, n > 1), a second launch of the same kernel (SHARED) has program (row block, KV head, split)
score a share of those keys for a block of the batch's query rows at once (each request's G heads
of that KV head, request after request), so the prefix is read once per batch instead of once per
request; the per-request programs then start after it (at the shared length, read from a device
scalar so that a CUDA graph replays any length), and the merge kernel combines both kinds of partials.

Extend (new tokens after a cached prefix) is flash attention: program (query block, request, KV
head) takes a block of the request's new tokens times the G heads of one KV head as its rows, and
walks the request's keys (prefix and new, already in the pool; slots from the same table) up to the
block's last visible position; query i of a request with prefix P sees keys at positions <= P + i.

Softmax runs in base 2 (the scale carries log2(e)) and every statistic and accumulator is float32
whatever the pool's dtype. Nothing here needs more than the interpreter offers: with
`TRITON_INTERPRET=1` set before this module is imported, the kernels run on CPU tensors (tests).
One difference is handled: the interpreter multiplies bfloat16 operands of `tl.dot` as their raw
uint16 bits, so under it (UPCAST) the operands go to float32 first, which gives the same products
(a product of two bfloat16 or float16 values is exact in float32) and the same float32 sums. The
interpreter runs programs one after another, each jit call in it costing milliseconds, so the
kernels call no jit helpers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton import knobs

# decided when the kernels are decorated, i.e. when this module is imported
INTERPRET: bool = bool(knobs.runtime.interpret)

DECODE_BLOCK_N = 64  # keys per step of a decode program
EXTEND_BLOCK_M = 64  # rows (query tokens x heads of a group) per extend program
EXTEND_BLOCK_N = 64  # keys per step of an extend program
SPLIT_LEN = 256  # keys a decode split should have at least before another split pays off
MAX_SPLITS = 16  # splits per (request, KV head), and of a shared prefix: partial buffers hold twice this many
SHARED_BLOCK_M = 64  # query rows per program of the cascade's shared pass
LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, rows_ptr, seq_lens_ptr, start_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, num_rows,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table, stride_ot, stride_oh,
    qk_scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SHARED: tl.constexpr, WINDOWED: tl.constexpr,
    SPLIT_BASE: tl.constexpr, TOTAL_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr, MAX_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (x, KV head, split). A request's pass (SHARED false): x is the request, its rows the
    G heads of the KV head, its keys the request's from `start` on. The cascade's shared pass: x is a
    block of BLOCK_M query rows (request r // G, head r % G), its keys the batch's first `start`.
    WINDOWED: a query sees only its request's last `window` keys."""
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    r = tl.arange(0, BLOCK_M)
    start = tl.load(start_ptr)  # the shared prefix's length (0 without one)
    if SHARED:
        r = tl.program_id(0) * BLOCK_M + r
        r_mask = r < num_rows
        req = r // GROUP
        heads = kv_head * GROUP + r % GROUP
        row = tl.load(rows_ptr)  # every request holds the prefix's slots: the first one's row names them
        first = 0
        length = start
        if WINDOWED:  # each row's own window: the keys before it are masked below
            row_lo = tl.load(seq_lens_ptr + req, mask=r_mask, other=0) - window
    else:
        r_mask = r < GROUP
        req = tl.program_id(0) + 0 * r
        heads = kv_head * GROUP + r
        row = tl.load(rows_ptr + tl.program_id(0))
        seq_len = tl.load(seq_lens_ptr + tl.program_id(0))
        first = start
        if WINDOWED:
            first = tl.maximum(start, seq_len - window)
        length = tl.maximum(seq_len - first, 0)  # a graph's padding row (one key) has none past a shared prefix
    # the row's own split plan (the merge kernel repeats it): whole key blocks per split, so only the
    # last block is ragged; a program past the row's splits has nothing to add
    chunk = tl.cdiv(tl.maximum(tl.cdiv(length, MAX_SPLITS), SPLIT_LEN), BLOCK_N) * BLOCK_N
    if TOTAL_SPLITS > 1 and split * chunk >= length:
        return
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, first + length)

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + req[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block in range(lo, hi, BLOCK_N):
        n = block + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        slots = tl.load(table_ptr + row * stride_table + n, mask=n_mask, other=0)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = n_mask[None, :]
        if SHARED and WINDOWED:
            visible = visible & (n[None, :] >= row_lo[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays at 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        pv = p.to(v.dtype)  # the value product's inputs in the pool's dtype, as flash attention does
        if UPCAST:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m = m_new

    # a split past the end of its keys saw none: output 0, weight exp2(-inf) = 0
    seen = den > 0
    den = tl.where(seen, den, 1.0)
    o = acc / den[:, None]
    if TOTAL_SPLITS == 1:
        tl.store(out_ptr + req[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # partials are contiguous [B, H, TOTAL_SPLITS, HEAD_DIM] and [B, H, TOTAL_SPLITS]: the requests'
        # splits first, the shared prefix's from SPLIT_BASE on
        num_heads = tl.num_programs(1) * GROUP
        at = (req * num_heads + heads) * TOTAL_SPLITS + SPLIT_BASE + split
        tl.store(mid_o_ptr + at[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        tl.store(mid_lse_ptr + at, tl.where(seen, m + tl.log2(den), float("-inf")), mask=r_mask)


@triton.jit
def _merge_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr, start_ptr, stride_ot, stride_oh, window,
    HEAD_DIM: tl.constexpr, OWN_SPLITS: tl.constexpr, TOTAL_SPLITS: tl.constexpr, SHARED: tl.constexpr,
    WINDOWED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """Program (request, head): the weighted sum of the partials its splits wrote (the request's own
    from slot 0, the shared prefix's from OWN_SPLITS on), added in slot order, real splits only."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    base = (req * tl.num_programs(1) + head) * TOTAL_SPLITS
    start = tl.load(start_ptr)
    seq_len = tl.load(seq_lens_ptr + req)
    first = start
    if WINDOWED:
        first = tl.maximum(start, seq_len - window)
    length = tl.maximum(seq_len - first, 0)
    own = tl.cdiv(length, tl.cdiv(tl.maximum(tl.cdiv(length, MAX_SPLITS), SPLIT_LEN), BLOCK_N) * BLOCK_N)
    shared = 0
    if SHARED:
        shared = tl.cdiv(start, tl.cdiv(tl.maximum(tl.cdiv(start, MAX_SPLITS), SPLIT_LEN), BLOCK_N) * BLOCK_N)
    # slot of the i-th real split: the own ones from 0, the shared ones from OWN_SPLITS
    top = float("-inf")
    for i in range(0, own + shared):
        top = tl.maximum(top, tl.load(mid_lse_ptr + base + tl.where(i < own, i, OWN_SPLITS + i - own)))
    top = tl.where(top == float("-inf"), 0.0, top)  # a row without keys (a graph's padding row)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    total = 0.0
    for i in range(0, own + shared):
        slot = base + tl.where(i < own, i, OWN_SPLITS + i - own)
        w = tl.exp2(tl.load(mid_lse_ptr + slot) - top)
        acc = tl.fma(tl.load(mid_o_ptr + slot * HEAD_DIM + d, mask=d_mask, other=0.0), w, acc)
        total = total + w
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + req * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qo_indptr_ptr, table_ptr, rows_ptr, seq_lens_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table, stride_ot, stride_oh,
    qk_scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOWED: tl.constexpr, TOKENS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    req = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + req)
    n_new = tl.load(qo_indptr_ptr + req + 1) - q_start
    first = block * TOKENS
    if first >= n_new:  # the grid is sized for the batch's longest extend
        return
    row = tl.load(rows_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    prefix = seq_len - n_new

    r = tl.arange(0, BLOCK_M)
    tok = first + r // GROUP  # row r is token tok, head g of the group
    heads = kv_head * GROUP + r % GROUP
    r_mask = (r < TOKENS * GROUP) & (tok < n_new)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + tok

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = prefix + tl.minimum(first + TOKENS, n_new)
    lo = 0
    if WINDOWED:  # the block's first query sees the window's keys before it; later ones fewer
        lo = tl.maximum(prefix + first - window + 1, 0)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        slots = tl.load(table_ptr + row * stride_table + n, mask=n_mask, other=0)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slots[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (q_pos[:, None] - n[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays at 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slots[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        pv = p.to(v.dtype)  # the value product's inputs in the pool's dtype, as flash attention does
        if UPCAST:
            pv = pv.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=PRECISION)
        m = m_new

    den = tl.where(den > 0, den, 1.0)  # a padding row (past its request's tokens) saw no key
    o = acc / den[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


# ---------------------------------------------------------------- launchers
def num_splits(max_len: int) -> int:
    """Programs per (request, KV head) for rows of up to `max_len` keys: as many as the longest row's
    plan may need (each split at least SPLIT_LEN keys, at most MAX_SPLITS). A graph bucket passes its
    length bound, so its grid (and the partial buffers' shape) never changes between replays."""
    return min(MAX_SPLITS, max(1, math.ceil(max_len / SPLIT_LEN)))


def _dot_args(dtype: torch.dtype) -> dict:
    # float32 scores keep full precision (tf32 would miss the 1e-5 the tests ask for)
    return {"UPCAST": INTERPRET, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every side >= 16


def decode(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
           rows: torch.Tensor, seq_lens: torch.Tensor, start: torch.Tensor, splits: int, shared_splits: int,
           mid_o: torch.Tensor | None, mid_lse: torch.Tensor | None, scale: float, window: int = 0) -> None:
    """out[b] = attention of q[b] ([B, H, D]) over the keys at table[rows[b], :seq_lens[b]] (with a
    `window`, the last `window` of them).

    With shared_splits > 0 the batch's first `start` keys ([1] int64 on the device) are the same slots
    for every request and are read once, in that many splits; the requests' own splits start after
    them. With splits + shared_splits > 1, mid_o [B, H, splits + shared_splits, D] and mid_lse
    [B, H, splits + shared_splits] (float32, contiguous) hold the partial results until the merge."""
    b, h, d = q.shape
    kvh = pool_k.shape[1]
    group = h // kvh
    total = splits + shared_splits
    args = (q, pool_k, pool_v, table, rows, seq_lens, start, out, mid_o if total > 1 else out,
            mid_lse if total > 1 else out, b * group, q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1),
            pool_v.stride(0), pool_v.stride(1), table.stride(0), out.stride(0), out.stride(1), scale * LOG2E, window)
    plan = {"BLOCK_N": DECODE_BLOCK_N, "SPLIT_LEN": SPLIT_LEN, "MAX_SPLITS": MAX_SPLITS}
    shape = {"GROUP": group, "HEAD_DIM": d, "TOTAL_SPLITS": total, "WINDOWED": window > 0, "BLOCK_D": _block_d(d),
             **plan, **_dot_args(q.dtype)}
    _decode_kernel[(b, kvh, splits)](*args, SHARED=False, SPLIT_BASE=0,
                                     BLOCK_M=max(16, triton.next_power_of_2(group)), **shape)
    if shared_splits:
        _decode_kernel[(triton.cdiv(b * group, SHARED_BLOCK_M), kvh, shared_splits)](
            *args, SHARED=True, SPLIT_BASE=splits, BLOCK_M=SHARED_BLOCK_M, **shape)
    if total > 1:
        _merge_splits_kernel[(b, h)](
            mid_o, mid_lse, out, seq_lens, start, out.stride(0), out.stride(1), window,
            HEAD_DIM=d, OWN_SPLITS=splits, TOTAL_SPLITS=total, SHARED=shared_splits > 0, WINDOWED=window > 0,
            BLOCK_D=triton.next_power_of_2(d), **plan,
        )


def extend(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, out: torch.Tensor, qo_indptr: torch.Tensor,
           table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, max_extend: int, scale: float,
           window: int = 0) -> None:
    """out[t] = causal attention of q[t] ([T, H, D]; request r's rows qo_indptr[r]:qo_indptr[r + 1],
    its last tokens) over the keys at table[rows[r], :seq_lens[r]] (with a `window`, a query sees
    itself and the window - 1 keys before it)."""
    t, h, d = q.shape
    kvh = pool_k.shape[1]
    group = h // kvh
    block_m = max(EXTEND_BLOCK_M, triton.next_power_of_2(group))
    tokens = block_m // group
    _extend_kernel[(triton.cdiv(max_extend, tokens), qo_indptr.numel() - 1, kvh)](
        q, pool_k, pool_v, out, qo_indptr, table, rows, seq_lens,
        q.stride(0), q.stride(1), pool_k.stride(0), pool_k.stride(1), pool_v.stride(0), pool_v.stride(1),
        table.stride(0), out.stride(0), out.stride(1), scale * LOG2E, window,
        GROUP=group, HEAD_DIM=d, WINDOWED=window > 0, TOKENS=tokens, BLOCK_M=block_m, BLOCK_D=_block_d(d),
        BLOCK_N=EXTEND_BLOCK_N,
        **_dot_args(q.dtype),
    )
