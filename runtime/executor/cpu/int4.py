"""4-bit weights on the CPU (`--quantization int4`): torch's int4 group kernel on the model's matmuls.

`torch.ops.aten._weight_int4pack_mm_for_cpu` multiplies bfloat16 rows by 4-bit weights in groups of
32 along the input, each group with a scale and a zero: w = (q - 8) * scale + zero. A GGUF's Q4_1
block is 32 four-bit values with an fp16 scale d and minimum m (w = d * q + m): scale = d and
zero = m + 8d are the file's own weights; Q4_0 (w = d * (q - 8)) is zero = 0. Q4_K (the matmuls of
the common Q4_K_M files) holds 8 such groups a block of 256, each group's scale and minimum 6-bit
multiples of the block's two fp16 scales (w = d * sc * q - dmin * m). So a model converted from a
Q4_0 / Q4_1 / Q4_K GGUF runs on the file's own numbers, as llama.cpp does (`gguf_blocks`), within
the rounding of the scales and zeros to bfloat16 (a relative 2^-8 each); those layers are made from
the file, a matrix at a time, before the checkpoint is read, and its float32 copies of them are never
loaded (`int4_from_file`). Other matmuls (a GGUF's Q6_K or Q8_0 ones, any other source's) are
rounded to the nearest 4-bit group (`quantize`: min/max per group, as Q4_1 is made) when int4 is
asked for; chosen by `auto`, they stay fp16 (`round_to_int4`).
The lm_head stays fp16 (cpu/fp16.py), as llama.cpp keeps it at 8 bits or more; the token embeddings
are the file's Q8_0 rows where it holds them so (cpu/gguf_embedding.py), else fp16 too.

The kernel's rows are bfloat16 on every path: a row's result does not depend on its batch only as
far as the kernel's blocking does not (enable_deterministic_inference refuses int4).

A long prefill is another shape: the kernel is compute-bound there, at a third of what a bfloat16
matmul reaches on a CPU with bfloat16 dot products (AVX512-BF16, AMX). From `prefill_rows()` rows on
such a CPU, the layer unpacks its weight to bfloat16 for the call (the same numbers the kernel
multiplies by) and runs one bfloat16 matmul; the unpacking costs a fraction of the product it
speeds up (benchmarks/README.md, "Prefill"). With AMX's tile products that happens from fewer rows.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from radixlm.runtime.executor.cache_prune import recorded_source
from radixlm.runtime.executor.gguf_tensors import (
    BLOCKS,
    LAYER_NAMES,
    LLAMA_LAYOUT,
    permuted_heads,
    read_gguf,
    unpermute_rows,
)
from radixlm.runtime.executor.models.linear import Linear

logger = logging.getLogger(__name__)

GROUP = 32
# rows from which a product runs on the unpacked bfloat16 weight (where `bf16_matmuls`): about where
# the kernel and the unpacking plus a bfloat16 matmul take as long, for SmolLM2's layers on two cores
# (benchmarks/README.md, "Prefill")
PREFILL_ROWS = 512  # AVX512-BF16
PREFILL_ROWS_AMX = 256  # AMX's tile products
_Q4 = ("Q4_0", "Q4_1", "Q4_K")  # the GGUF block types whose values are this kernel's groups as they are
# a llama-architecture GGUF's matmuls, by the name of the fused matrix they make up (in row order)
_GGUF_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
               "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


class Int4Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None):
        """q: integers [N, K] in 0..15; scale, zero: [N, K / GROUP] (w = (q - 8) * scale + zero)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        self.register_buffer("scales_zeros", torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16)
                             .contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        # rows from which a product runs on the unpacked weight (None: always on the kernel)
        self.unpack_from = prefill_rows() if self.out_features % 64 == 0 and bf16_matmuls() else None
        self.register_buffer("group", torch.tensor(GROUP), persistent=False)  # the compiled kernel's argument

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(torch.bfloat16)
        if torch.compiler.is_compiling():
            # a compiled forward runs shorter steps only (compiled_forward.py): the kernel, through its own
            # op, which the graph calls as it is (inductor's rewrite of the aten op below fails inside a
            # region traced once for every layer)
            out = torch.ops.quantized.int4mm_packed_weight_cpu(rows, self.packed, self.group, self.scales_zeros)
        elif self.unpack_from is not None and rows.shape[0] >= self.unpack_from:
            out = torch.mm(rows, self.unpacked().t())
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2

    def unpacked(self) -> torch.Tensor:
        """The bfloat16 weight [N, K] the kernel multiplies by, read off its packing (N a multiple of 64)."""
        n, k = self.out_features, self.in_features
        q = unpack(self.packed, n, k).view(n, k // GROUP, GROUP)
        scale, zero = (self.scales_zeros[..., i].t().float().unsqueeze(-1) for i in (0, 1))  # [N, K / GROUP, 1]
        return (q.float() - 8).mul_(scale).add_(zero).view(n, k).to(torch.bfloat16)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] the kernel multiplies by (its scales and zeros in bfloat16)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, self.scales_zeros).float().t()


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The values 0..15 [N, K] of torch's CPU int4 packing for N a multiple of 64: blocks of 64 rows,
    each k a byte per pair of rows j and j + 32 (low and high nibble). `bf16_matmuls` checks this
    layout against the packing itself before anything relies on it."""
    v = packed.view(n // 64, k, 32)
    return torch.cat([v & 0xF, v >> 4], dim=2).transpose(1, 2).reshape(n, k)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


@functools.cache
def prefill_rows() -> int:
    """Rows from which a product runs on the unpacked bfloat16 weight (where `bf16_matmuls`)."""
    return PREFILL_ROWS_AMX if "amx_bf16" in _cpu_flags() else PREFILL_ROWS


@functools.cache
def bf16_matmuls() -> bool:
    """Whether long products run on unpacked bfloat16 weights here: the CPU has bfloat16 dot products
    (where oneDNN emulates them, the 4-bit kernel stays faster) and `unpack` reads this torch's layout."""
    if not {"avx512_bf16", "amx_bf16"} & _cpu_flags():
        return False
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    return torch.equal(unpack(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), 128, 64).int(), q)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, zero) of a float weight [N, K]: each group's min and max span the 16 levels."""
    n, k = weight.shape
    groups = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
    return q, scale, lo + 8 * scale


def gguf_blocks(kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, zero) of a Q4_0 / Q4_1 / Q4_K tensor's raw rows [N, blocks * block bytes]; q stays uint8 (a
    quarter of int32's memory traffic while the fused matrices are put together)."""
    if kind == "Q4_K":
        return _q4_k(raw)
    size = BLOCKS[kind][1]
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(n, -1, size)  # a copy: the file's map is read-only
    d = _halves(blocks[..., 0:2])
    offset = 2 if kind == "Q4_0" else 4
    m = _halves(blocks[..., 2:4]) if kind == "Q4_1" else None
    nibbles = blocks[..., offset:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).view(n, -1)  # a block's low nibbles come first
    zero = torch.zeros_like(d) if m is None else m + 8 * d
    return q, d, zero


def _q4_k(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K block (ggml's block_q4_K): fp16 d and dmin, 12 bytes packing 8 six-bit scales and 8
    six-bit minimums, then 128 bytes whose 32-byte runs hold two groups each (low nibbles, then high)."""
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(n, -1, BLOCKS["Q4_K"][1])
    d, dmin = _halves(blocks[..., 0:2]), _halves(blocks[..., 2:4])
    s = blocks[..., 4:16].to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=-1)  # groups 0-3, then 4-7
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    nibbles = blocks[..., 16:].reshape(n, -1, 4, 1, 32)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-2).view(n, -1)  # group 2j: run j's low nibbles
    scale = (d[..., None] * sc).view(n, -1)
    return q, scale, 8 * scale - (dmin[..., None] * mins).view(n, -1)


def _halves(pair: torch.Tensor) -> torch.Tensor:
    """float32 [...] of fp16 values stored as their two bytes [..., 2]."""
    return pair.contiguous().view(torch.float16).squeeze(-1).float()


def read_gguf_matmuls(path: Path, config) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The Q4_0 / Q4_1 / Q4_K matmuls of a llama, qwen2 or qwen3 GGUF under the model's fused names
    ("layers.N.self_attn.qkv_proj", ...); a matrix any of whose parts has another type is left out."""
    return dict(iter_gguf_matmuls(path, config))


def iter_gguf_matmuls(path: Path, config) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """`read_gguf_matmuls` a matrix at a time: its values are unpacked one int32 a weight, which for
    every layer at once would be eight times the file's blocks in memory."""
    arch, tensors = read_gguf(path)
    if arch not in LLAMA_LAYOUT:
        return
    for i in range(config.num_hidden_layers):
        for fused, parts in _GGUF_PARTS.items():
            found = [tensors.get(f"blk.{i}.{p}.weight") for p in parts]
            if any(t is None or t.kind not in _Q4 for t in found):
                continue
            pieces = []
            for t in found:
                q, scale, zero = gguf_blocks(t.kind, t.data)
                if (heads := permuted_heads(arch, t.name, config)) is not None:
                    q, scale, zero = (unpermute_rows(x, heads) for x in (q, scale, zero))
                pieces.append((q, scale, zero))
            yield f"layers.{i}.{fused}", tuple(torch.cat(x, dim=0) for x in zip(*pieces))


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a converted folder was made from (cache_prune's record), if any."""
    recorded = recorded_source(folder)
    if recorded is None:
        return None
    source = Path(recorded)
    return source if source.suffix.lower() == ".gguf" and source.is_file() else None


def int4_unavailable() -> str | None:
    """Why this torch cannot run int4 here, or None."""
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    return "this torch has no int4 CPU kernel (_weight_int4pack_mm_for_cpu)"


def has_4bit_matmuls(folder: Path) -> bool:
    """Whether the model came from a GGUF whose layers' matmuls this module reads as they are (a
    llama, qwen2 or qwen3 file with Q4_0 / Q4_1 / Q4_K blocks): `--quantization auto` then runs them."""
    source = gguf_source(folder)
    if source is None:
        return False
    arch, tensors = read_gguf(source)
    return arch in LLAMA_LAYOUT and any(name.startswith("blk.") and t.kind in _Q4 for name, t in tensors.items())


def int4_from_file(model: nn.Module, folder: Path) -> frozenset[str]:
    """Replaces the decoder layers' matmuls that the model's GGUF holds as Q4_0 / Q4_1 / Q4_K blocks by
    Int4Linear, before any weight is loaded; returns the checkpoint names of the float weights they
    replace, which the loader then never reads (a 7B model's would be 28 GB of float32 in memory)."""
    bf16_matmuls(), prefill_rows()  # decided at load: no request's product reads /proc
    source = gguf_source(folder)
    replaced: set[str] = set()
    for name, (q, scale, zero) in iter_gguf_matmuls(source, model.config) if source is not None else ():
        module = model.get_submodule(name)
        if not isinstance(module, Linear) or module.in_features % GROUP:
            continue
        parent, _, child = name.rpartition(".")
        # the bias (Qwen2's q/k/v) keeps its name: the checkpoint's values are loaded into it next
        setattr(model.get_submodule(parent), child, Int4Linear(q, scale, zero, module.bias))
        layers, index, fused = name.split(".", 2)  # "layers", "N", "self_attn.qkv_proj"
        replaced.update(f"model.{layers}.{index}.{LAYER_NAMES[part]}.weight" for part in _GGUF_PARTS[fused])
    return frozenset(replaced)


def round_to_int4(model: nn.Module) -> int:
    """Replaces the decoder layers' remaining float matmuls by Int4Linear, each group of GROUP inputs
    rounded to its nearest 16 levels (`quantize`); returns how many."""
    rounded = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or ".layers." not in f".{name}" or module.in_features % GROUP:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int4Linear(*quantize(module.weight.data), module.bias))
        rounded += 1
    return rounded
