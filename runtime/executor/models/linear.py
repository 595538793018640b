"""The model's dense matmuls, on the fastest CPU kernel torch ships.

torch computes a float32 `F.linear` on the CPU with MKL's sgemm. On some CPUs that runs far below
what the vector units allow: on AMD EPYC CPUs with AVX-512 MKL takes its generic AVX2 path, and
oneDNN's float32 matmul, which torch also ships, runs about twice as fast. oneDNN's matmul is exposed as
`torch.ops.mkldnn._linear_pointwise`; it takes the ordinary dense weight, so parameters stay
plain tensors (no packed copy, no extra memory). bf16/fp16 linears already go through oneDNN
inside torch, so only float32 is rerouted.

`choose_gemm` decides once per model; a check against `F.linear` on a small product guards
against a build whose oneDNN op is missing or wrong (then the model keeps torch's kernel).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
           min_rows: int = 1) -> torch.Tensor:
    """`min_rows` > 1: fewer rows are padded with zero rows (dropped after), so a lone row takes the
    kernel path the rows of a batch take (deterministic inference: `rows_invariant`)."""
    if torch.compiler.is_compiling():  # behind an op: inductor would fuse oneDNN's op its own way (compiled_forward.py)
        return torch.ops.radixlm.linear(x, weight, bias, onednn, min_rows)
    n = x.shape[0]
    if n < min_rows:
        x = torch.cat([x, x.new_zeros(min_rows - n, *x.shape[1:])])
    out = onednn_linear(x, weight, bias) if onednn else F.linear(x, weight, bias)
    return out[:n] if n < min_rows else out


class Linear(nn.Linear):
    """nn.Linear whose matmul runs on oneDNN when the model chose it (the model's `set_gemm`)."""

    onednn: bool = False
    min_rows: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.onednn, self.min_rows)


@functools.cache
def rows_invariant(min_rows: int = 2) -> bool:
    """Whether oneDNN's float32 matmul gives a row the same bits among `min_rows` rows as among
    thousands, on this CPU and at shapes like a small model's (typically yes from 2 rows; a lone
    row takes another path, and MKL's sgemm differs up to 128 rows at some shapes). Measured
    once per process: it is a property of the CPU and the build."""
    gen = torch.Generator().manual_seed(0)
    for k, n in ((576, 1536), (1536, 576)):
        x, w = torch.randn(1100, k, generator=gen), torch.randn(n, k, generator=gen)
        whole = onednn_linear(x, w, None)
        for rows in (min_rows, min_rows + 1, 257):
            if not torch.equal(onednn_linear(x[-rows:], w, None), whole[-rows:]):
                return False
    return True


def onednn_usable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when oneDNN can run this model's matmuls, else why not."""
    if device.type != "cpu" or dtype != torch.float32:
        return f"only float32 on the CPU is rerouted (model is {str(dtype).removeprefix('torch.')} on {device})"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN matmul"
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=gen) for shape in ((5, 3, 64), (48, 64), (48,)))
    try:
        with torch.inference_mode():
            got, want = onednn_linear(x, w, b), F.linear(x, w, b)
    except RuntimeError as e:
        return f"oneDNN matmul failed: {e}"
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=1e-4):
        return "oneDNN matmul disagrees with F.linear"
    return None


def choose_gemm(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """'onednn' or 'torch' for `choice` ("auto", or one of them forced: EngineArgs.forced_kernel);
    'onednn' forced but unusable raises."""
    if choice == "torch":
        return "torch"
    why_not = onednn_usable(device, dtype)
    if why_not is None:
        return "onednn"
    if choice == "onednn":
        raise ValueError(f"the oneDNN matmul cannot be used: {why_not}")
    logger.debug("matmuls on torch's kernel: %s", why_not)
    return "torch"
