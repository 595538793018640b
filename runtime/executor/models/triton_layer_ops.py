"""A decoder layer's small ops as one Triton kernel each, for models on the Triton attention backend.

Between its matmuls and its attention a llama layer runs about a dozen small kernels on a GPU: the
residual adds, the norms, RoPE's multiplies, concatenation and add, two K/V writes, SiLU and its
product. At batch 1 each costs a launch and a pass over a few kilobytes, so together they take as
long as the matmuls. Three kernels replace them:
- `add_rms_norm`: the residual add and the next RMSNorm, one read of each row and two writes (the
  sum, which the layer carries on, and its normalized copy);
- `rope_store`: q and k rotated by their positions and k and v written to their KV-pool slots, from
  the fused projection's output [T, heads + 2 * kv_heads, D], so the attention reads the pool only;
- `silu_mul`: SiLU(gate) * up from the fused gate/up projection's output [T, 2 * I].
Each computes in float32 and rounds once where the torch ops round after every op, so results agree
with them to the rounding of the dtype (float32: to a few ulps).

Checked on the CPU under `TRITON_INTERPRET=1` (set before this module is imported) against the
torch ops they replace (tests/test_triton_layer_ops.py); a model uses them where its attention
backend is Triton's (`LlamaForCausalLM.fused_ops`), so never on the CPU's own backends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, sum_ptr, out_ptr, n, eps, stride_x, stride_d, stride_s, stride_o,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    if HAS_DELTA:
        # the sum is rounded to the rows' dtype before it is normalized, as the unfused layer does
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=inside, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=inside)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight) for rows x, delta [T, N]; without delta, (x, RMSNorm(x))."""
    t, n = x.shape
    out = torch.empty_like(x)
    total = x if delta is None else torch.empty_like(x)
    if t:
        d = x if delta is None else delta
        _add_rms_norm_kernel[(t,)](x, d, weight, total, out, n, eps, x.stride(0), d.stride(0), total.stride(0),
                                   out.stride(0), HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n))
    return total, out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=inside, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=inside)


SILU_BLOCK = 1024  # intermediate values per program


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for rows [T, 2 * I] holding gate then up -> [T, I]."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                          BLOCK=block)
    return out


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_pool_ptr, v_pool_ptr,
                       stride_qkv_t, stride_qkv_h, stride_cos, stride_q_t, stride_q_h, stride_pool_slot,
                       stride_pool_h, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       ROT: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)  # a query head, then the KV heads
    d = tl.arange(0, BLOCK_D)
    inside = d < HEAD_DIM
    src = qkv_ptr + token * stride_qkv_t + head * stride_qkv_h
    x = tl.load(src + d, mask=inside, other=0.0).to(tl.float32)
    # rotate_half: the first half of the rotary dims takes minus the second (the sign is in the table)
    half = ROT // 2
    partner = tl.where(d < half, d + half, d - half)
    rotary = d < ROT
    other = tl.load(src + partner, mask=rotary, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos + d, mask=rotary, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + d, mask=rotary, other=0.0).to(tl.float32)
    y = tl.where(rotary, x * cos + other * sin, x)
    if head < HEADS:
        tl.store(q_ptr + token * stride_q_t + head * stride_q_h + d, y.to(q_ptr.dtype.element_ty), mask=inside)
    else:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        dst = slot * stride_pool_slot + (head - HEADS) * stride_pool_h + d
        tl.store(k_pool_ptr + dst, y.to(k_pool_ptr.dtype.element_ty), mask=inside)
        v = tl.load(src + KV_HEADS * stride_qkv_h + d, mask=inside, other=0.0)
        tl.store(v_pool_ptr + dst, v.to(v_pool_ptr.dtype.element_ty), mask=inside)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               slots: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
    """The rotated queries [T, heads, D] of the fused projection's output ``qkv`` [T, heads + 2 *
    kv_heads, D] (each head's D values contiguous); its keys, rotated, and its values are written to
    ``k_pool`` / ``v_pool`` [slots, kv_heads, D] at ``slots`` [T]. ``cos`` / ``sin`` [T, 1, R]: the
    RoPE tables of the tokens' positions (R <= D rotary dims, the sign of rotate_half in ``sin``)."""
    t, _, dim = qkv.shape
    q = torch.empty(t, heads, dim, dtype=qkv.dtype, device=qkv.device)
    if t:
        cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
        _rope_store_kernel[(t, heads + kv_heads)](
            qkv, cos, sin, slots, q, k_pool, v_pool, qkv.stride(0), qkv.stride(1), cos.stride(0), q.stride(0),
            q.stride(1), k_pool.stride(0), k_pool.stride(1), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=dim,
            ROT=cos.shape[1], BLOCK_D=triton.next_power_of_2(dim))
    return q
