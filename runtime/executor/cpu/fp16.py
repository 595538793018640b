"""fp16 weights on the CPU (`--quantization fp16`): every matmul weight stored in half precision and
multiplied by fbgemm's fp16 GEMM (torch's `quantized::linear_dynamic_fp16`), activations and sums in
float32.

A decode step reads every weight once, so its products cost what their bytes cost: half of float32's
(benchmarks/README.md, "CPU weight formats"). Unlike int8 it rounds nothing but the weights, to 11
significant bits, so its answers stay close to float32's (`benchmarks/quality.py`).

What it is not: batch-invariant. Like MKL's and oneDNN's float32 kernels, fbgemm takes other paths for
some row counts (1, 2, 7 and 31 rows among those measured), so a row's last bits may depend on how many
rows share its product, as in float32 mode (which the torch attention backend shares); int8 is the
mode whose answers never depend on the batch.

The fp16 copy is made at load from the float32 weights, on a thread per core (`to_fp16`; a cache
file would still have to be packed). Token embeddings are kept in fp16 too and widened per looked-up row; a
model with tied embeddings gets the lm_head packed from the same fp16 values.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from radixlm.runtime.executor.cpu.ops import direct_op, no_subclass_dispatch
from radixlm.runtime.executor.models.linear import Linear

try:
    _PREPACK = torch.ops.quantized.linear_prepack_fp16
    _LINEAR = direct_op(torch.ops.quantized.linear_dynamic_fp16.default)
except (AttributeError, RuntimeError):  # a build without fbgemm: `fp16_unavailable` says so
    _PREPACK = _LINEAR = None


class Fp16Linear(nn.Module):
    """A linear layer on fbgemm-packed fp16 weights (the float32 matrix itself is not kept).

    `tag` [out] is a placeholder tensor that names the layer to the compiled forward's op
    (executor/compiled_forward.py): the packed weights are opaque to torch.compile."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.has_bias = bias is not None
        self.packed = _PREPACK(weight.detach().float().contiguous(), None if bias is None else bias.detach().float())
        self.register_buffer("tag", torch.zeros(self.out_features), persistent=False)

    @property
    def nbytes(self) -> int:
        return 2 * self.out_features * self.in_features + (4 * self.out_features if self.has_bias else 0)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        with no_subclass_dispatch():  # see cpu/ops.py: a TorchBind argument costs a C++ exception
            return _LINEAR(rows, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.radixlm.packed_linear(rows, self.tag)
        else:
            y = self.product(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp16 (fbgemm)"


class Fp16Embedding(nn.Module):
    """Token embeddings held as fp16 rows, widened to float32 as they are looked up. The rows are kept
    as int16 bits so that `model.to(float32)` leaves them alone."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("bits", weight.detach().to(torch.float16).contiguous().view(torch.int16))

    @property
    def weight(self) -> torch.Tensor:
        return self.bits.view(torch.float16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bits[ids].view(torch.float16).float()


@functools.cache
def fp16_unavailable() -> str | None:
    """None when fbgemm's fp16 GEMM runs here and matches float64 on fp16-rounded weights (a small
    product at a few row counts, within float32's rounding), else why not. Checked once per process."""
    if _PREPACK is None or "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm fp16 matmul"
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    try:
        layer = Fp16Linear(w, b)
        for rows in (1, 3, 17):
            x = torch.randn(rows, 96, generator=gen)
            want = (x.double() @ w.half().double().t() + b.double()).float()
            if not torch.allclose(layer(x), want, rtol=1e-4, atol=1e-4):
                return f"fbgemm's fp16 matmul disagrees with float64 on {rows} row(s)"
    except (RuntimeError, TypeError) as e:
        return f"fbgemm's fp16 matmul failed: {type(e).__name__}: {str(e)[:200]}"
    return None


def to_fp16(model: nn.Module, threads: int = 0) -> int:
    """Replaces every float32 `Linear` of `model` by an `Fp16Linear` and its token embeddings by fp16
    rows (a tied lm_head gets its own packed copy); returns the number of layers packed.

    fbgemm packs a matrix on one core and releases the GIL, so the matrices are packed on `threads`
    threads (torch's intra-op count when 0); packing is a visible part of start-up
    (benchmarks/README.md, "Server start-up")."""
    slots = [(module, name, child) for module in list(model.modules())
             for name, child in list(module.named_children()) if isinstance(child, Linear)]
    jobs = [(child.weight, child.bias) for _, _, child in slots]
    embed = getattr(model, "embed_tokens", None)
    half = Fp16Embedding(embed.weight) if isinstance(embed, nn.Embedding) else None
    tied_head = (half is not None and getattr(model, "tie_word_embeddings", False)
                 and getattr(model, "lm_head", None) is None)
    if tied_head:
        jobs.insert(0, (half.weight.float(), None))  # the rows the lookups see; the largest matrix, so first
    with ThreadPoolExecutor(max(1, threads or torch.get_num_threads()), thread_name_prefix="radixlm-fp16-pack") as pool:
        layers = list(pool.map(lambda job: Fp16Linear(*job), jobs))
    if tied_head:
        model.lm_head = layers.pop(0)
    for (module, name, _), layer in zip(slots, layers, strict=True):
        setattr(module, name, layer)
    if half is not None:
        model.embed_tokens = half
    return len(jobs)


def fp16_packs(model: nn.Module) -> dict[int, Any]:
    """tag data_ptr -> the layer's product, for the compiled forward's op."""
    return {m.tag.data_ptr(): m.product for m in model.modules() if isinstance(m, Fp16Linear)}
