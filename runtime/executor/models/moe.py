"""Sparse mixture of experts (Mixtral, Qwen3-MoE): each token goes through its top-k experts.

The router's softmax and top-k run in float32, as the reference's do, so a token picks the same
experts in any dtype the router's logits allow. Experts are stored stacked (`w13`: gate and up
rows of every expert, `w2`: down), loaded from either checkpoint layout (one tensor per expert, or
transformers' stacked `experts.gate_up_proj` / `experts.down_proj`).

`grouped_experts` is the torch implementation, used on the CPU: the batch's (token, expert) pairs
sorted by expert, one gate/up and one down matmul per expert that received tokens, accumulated in
expert order. On CUDA the experts run as grouped Triton matmuls with no host sync
(moe_triton.fused_experts, checked against this one under the Triton interpreter), so CUDA graphs
record its decode; torch.compile on the CPU cannot hold the grouped experts' host reads
(`compile_safe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """The gate's weight [experts, hidden]: a plain parameter, never a quantized Linear, so the
    choice of experts is the checkpoint's own."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, normalize: bool):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.top_k, self.normalize, self.inter = top_k, normalize, inter
        self.gate = Router(num_experts, hidden)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if x.is_cuda:
            from radixlm.runtime.executor.models.moe_triton import fused_experts

            return fused_experts(x, self.w13, self.w2, ids, weights)
        return grouped_experts(x, self.w13, self.w2, ids, weights)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One expert's `gate`, `up` or `down` matrix (the per-expert checkpoint layout)."""
        inter = self.inter
        target = {"gate": self.w13.data[expert, :inter], "up": self.w13.data[expert, inter:],
                  "down": self.w2.data[expert]}[part]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"expert {expert} {part}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = ids[t, k], for every token."""
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    flat_weights = weights.flatten()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start : start + n]
        start += n
        rows = pairs // top_k
        gate, up = F.linear(x[rows], w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, rows, (y * flat_weights[pairs, None]).to(out.dtype))
    return out
