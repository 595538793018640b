"""The sparse MoE block on CUDA: routed experts as two grouped matmuls in Triton, with no host sync.

The batch's (token, slot) pairs are grouped by expert on the device (`align`): each expert's pairs
padded to a whole number of BLOCK_M rows, so a block of rows belongs to one expert. `_grouped_matmul`
multiplies a block's rows (gathered from their token's row, or their own) by that expert's matrix.
The step is: gate/up for every pair, SiLU(gate) * up, down, each pair's output times its routing
weight, summed over a token's slots. Sizes are fixed by the batch's token count (the padded pair
buffer is as long as the worst case), so nothing is read back to the host.

Checked on the CPU under `TRITON_INTERPRET=1` (set before this module is imported) against
moe.grouped_experts. The interpreter multiplies bfloat16 operands of `tl.dot` as raw bits, so under
it (UPCAST) they go to float32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRET: bool = bool(knobs.runtime.interpret)
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit
def _grouped_matmul(
    a_ptr, w_ptr, c_ptr, pairs_ptr, block_expert_ptr, num_pairs, n, k, stride_am, stride_we, stride_wn, stride_cm,
    ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs  # the blocks past the last expert's hold only the sentinel
    rows = tl.where(valid, pairs // ROW_DIV, 0)
    expert = tl.maximum(expert, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & (ks[None, :] < k),
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                    mask=(cols[None, :] < n) & (ks[:, None] < k), other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, w)
    out = c_ptr + tl.where(valid, pairs, 0)[:, None] * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n))


def align(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair ids grouped by expert, each expert's run padded to BLOCK_M with the sentinel
    `ids.numel()`; the expert of every block of BLOCK_M, -1 past the last), sized for the worst case."""
    flat = ids.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(pairs, device=ids.device) - first_of_expert[flat[order]]
    size = pairs + num_experts * (BLOCK_M - 1)
    size = (size + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    sorted_pairs = torch.full((size,), pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[starts[flat[order]] + rank] = order
    block_starts = torch.arange(0, size, BLOCK_M, device=ids.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert.to(torch.int32)


def _matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pairs: torch.Tensor, block_expert: torch.Tensor,
            num_pairs: int, row_div: int) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, BLOCK_N))
    upcast = INTERPRET and a.dtype != torch.float32
    _grouped_matmul[grid](a, w, out, pairs, block_expert, num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1),
                          out.stride(0), ROW_DIV=row_div, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                          UPCAST=upcast)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """moe.grouped_experts' result from the grouped Triton matmuls: x [T, H], w13 [E, 2I, H],
    w2 [E, H, I], ids and weights [T, k]."""
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs, block_expert = align(ids, w13.shape[0])
    inter = w13.shape[1] // 2
    gate_up = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _matmul(x, w13, gate_up, pairs, block_expert, num_pairs, row_div=top_k)
    gate, up = gate_up.split(inter, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).contiguous()
    down = torch.empty(num_pairs, x.shape[1], dtype=x.dtype, device=x.device)
    _matmul(act, w2, down, pairs, block_expert, num_pairs, row_div=1)
    out = down.view(tokens, top_k, -1) * weights.unsqueeze(-1)
    return out.sum(dim=1).to(x.dtype)
