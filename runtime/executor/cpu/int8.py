"""int8 matmuls on the CPU (`--quantization int8`): per-channel weight scales, per-row activation scales.

The numbers every kernel here computes, bit for bit:

    weight  W[n, :] ~ Wq[n, :] * w_scale[n]    Wq int8 in [-127, 127], w_scale[n] = max|W[n, :]| / 127
    input   x[r, :] ~ xq[r, :] * s[r]          s[r] = max|x[r, :]| / 127, xq = round-half-even(x[r, :] / s[r])
    output  y[r, n] = float32(sum_k xq[r, k] * Wq[n, k]) * w_scale[n] * s[r]  (+ bias[n])

The sum is exact (int32), so its value does not depend on how a library blocks the product or on how
many rows it is given; every other step is per element or per row. A row's output therefore depends on
that row alone, whatever else is in the batch. (fbgemm's dynamic mode, `quantized::linear_dynamic`,
picks one activation scale for the whole call and so would make an answer depend on its batch.)

The int8 product runs on a library kernel, never our own: fbgemm (torch's quantized linear with a fixed
input quantization, scale 1 and zero point 128, applied to `xq`, which is already integral, so the
library's own rounding is a no-op; float32 out) or oneDNN (`onednn::qlinear_pointwise` on `xq` as int8
where the CPU has AMX tiles, else as uint8 with zero point 128, which its JIT kernels take on AVX-512
VNNI; input scale 1, per-channel weight scales, float32 out). `KERNELS` puts fbgemm first: it decodes
one request (the single-client case this mode is for) faster than oneDNN, which is only slightly faster
on decode batches and long prefills. oneDNN stays as the fallback: fbgemm's packing goes through
quantized tensors, which torch 2.13 deprecates. A kernel is used only if it reproduces the formula
exactly on a probe that would overflow a 16-bit intermediate (u8 x s8 pairs, what CPUs without VNNI
saturate), so every kernel that passes gives the same bits and the same answers. On such CPUs (AVX2
only: most laptops, AMD before Zen 4) both fail it, and their split forms (`_split`) take over: the same
library kernels on two halves of each row, small enough not to saturate, whose sums add up to the
formula's exactly. So int8 computes the same formula on every CPU; there its prefill products cost about
what float32's do (benchmarks/README.md, "CPU weight formats").

That is also why a layer may hold two packings and pick one per call by its row count
(`--int8-batch-packing`): on CPUs with AMX, oneDNN runs its tile kernels, several times faster than
fbgemm on tens to thousands of rows, but pays a tile set-up on every call, which makes one-row
products, and so one client's decode, slower than fbgemm's. So on such CPUs fbgemm takes the
products of fewer than `MANY_ROWS` rows and oneDNN the rest (prefills, decode batches), and a row
gets the same bits whichever kernel it goes through.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from radixlm.runtime.executor.cpu.ops import direct_op, no_subclass_dispatch

logger = logging.getLogger(__name__)

MANY_ROWS = 5  # rows from which a second packing (`many`) takes the product: where oneDNN-on-AMX overtakes fbgemm
QMAX = 127  # symmetric int8: -128 is never used, so negating a row or a weight is exact
_TINY = 1e-30  # an all-zero row gets this as its max: quantizes to zeros instead of 0/0


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qweight int8 [n, k], scale float32 [n]): symmetric per output channel (row of `weight`)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min_(_TINY).div_(QMAX)
    qweight = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return qweight, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, s) for a 2-D float32 `x`: s [M, 1] = max|row| / 127, xq = round(x / s), integers held in
    float32 (|xq| <= 127). Per row only: no statistic crosses rows."""
    s = x.abs().amax(dim=-1, keepdim=True).clamp_min_(_TINY).div_(QMAX)  # vector_norm(inf) is 10x slower
    return torch.div(x, s).round_(), s


# --------------------------------------------------------------------------------------------------
# kernels: pack(qweight, scale) -> handle; matmul(xq, handle) -> float32(xq @ qweight.T) * scale


@dataclass(frozen=True, slots=True)
class Int8Kernel:
    name: str
    pack: Callable[[torch.Tensor, torch.Tensor], Any]
    matmul: Callable[[torch.Tensor, Any], torch.Tensor]
    packed_bytes: Callable[[int, int], int]  # (out, in) -> bytes the handle holds
    # a split kernel's product on halves (`_split`): `split_rows(xq)` -> sums to `join_halves`; else None
    raw: Callable[[torch.Tensor, Any], torch.Tensor] | None = None


def _fbgemm_pack(qweight: torch.Tensor, scale: torch.Tensor) -> Any:
    n = qweight.shape[0]
    with warnings.catch_warnings():  # torch 2.13 marks quantized-tensor constructors deprecated
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(
            qweight.contiguous(), scale.double(), torch.zeros(n, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(qw, None)


def _missing(*args: Any) -> Any:
    raise AttributeError("torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32 is not in this build")


try:
    _FBGEMM_LINEAR = direct_op(torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default)
except (AttributeError, RuntimeError):  # a build without fbgemm: the probe says so
    _FBGEMM_LINEAR = _missing


def _fbgemm_matmul(xq: torch.Tensor, packed: Any, zero: int = 128) -> torch.Tensor:
    # input scale 1, zero point 128 (64 for a split kernel's halves): fbgemm reads xq + zero as uint8 and
    # subtracts the zero point exactly
    with no_subclass_dispatch():
        return _FBGEMM_LINEAR(xq, 1.0, zero, packed)


HALF_ZERO = 64  # the u8 zero point of a split kernel's halves (`_split`)
_ONE, _ZERO, _U8_ZERO, _U8_HALF_ZERO = torch.tensor(1.0), torch.tensor(0), torch.tensor(128), torch.tensor(HALF_ZERO)


@functools.cache
def _amx_tiles() -> bool:
    """Whether the CPU has AMX tiles (asked once per process)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def _onednn_pack(qweight: torch.Tensor, scale: torch.Tensor) -> Any:
    zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)
    return torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None), scale, zero_points, _amx_tiles()


def _onednn_matmul(xq: torch.Tensor, packed: Any, zero: torch.Tensor = _U8_ZERO) -> torch.Tensor:
    weight, scale, zero_points, signed = packed
    if signed:  # AMX tiles take s8 activations as they are (benchmarks/README.md, "CPU weight formats")
        x, x_zero = xq.to(torch.int8), _ZERO
    else:
        # without AMX, oneDNN runs s8 activations on its reference kernel with these weights, thousands
        # of times slower; as u8 with zero point 128, as fbgemm takes them, they run on its JIT kernel.
        # The sums are the same integers either way.
        x, x_zero = xq.add(zero).to(torch.uint8), zero
    return torch.ops.onednn.qlinear_pointwise.tensor(
        x, _ONE, x_zero, weight, scale, zero_points, None, 1.0, 0, torch.float32, "none", [], "")


# --------------------------------------------------------------------------------------------------
# split kernels: the same library kernels where their 16-bit pair sums saturate (CPUs without VNNI)

SPLIT_COLUMNS = 2048  # input columns per packed block: 2 x 64 x 127 x 2048 < 2**24 (exact in float32)
# halves of a row xq: a = xq / 2 - 1/4 and b = xq / 2 + 1/4 round to floor(xq / 2) and ceil(xq / 2)
# (never a tie: every value is an integer or half-integer plus 1/4), and those add up to xq
_HALF_OFFSETS = torch.tensor([-0.25, 0.25]).view(2, 1, 1)


def split_rows(xq: torch.Tensor) -> torch.Tensor:
    """[2M, K] from integral xq [M, K] in [-127, 127]: rows a then rows b, each within [-64, 64] once
    rounded (the kernels round their input), a + b = xq. One op, which a compiled forward fuses."""
    return torch.add(_HALF_OFFSETS, xq, alpha=0.5).view(-1, xq.shape[-1])


def join_halves(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32(xq @ Wq.T) * scale from a split kernel's sums over the halves [2M, N]: the two exact
    integer sums of a row added (rounded once, as the formula's), then scaled."""
    m = y.shape[0] // 2
    return torch.add(y[:m], y[m:]).mul_(scale)


@dataclass(frozen=True, slots=True)
class _SplitPacking:
    blocks: list[tuple[int, int, Any]]  # (first column, end column, the block packed with unit scales)
    scale: torch.Tensor  # [n] the weight scales, applied once the halves' sums are added


def _split(name: str, pack: Callable, halves_matmul: Callable, packed_bytes: Callable[[int, int], int]) -> Int8Kernel:
    """A kernel that computes the formula with `halves_matmul`'s library kernel on halves of each row.

    Without VNNI, fbgemm and oneDNN multiply u8 activations by s8 weights in pairs summed into 16 bits
    with saturation (vpmaddubsw): 255 x 127 twice does not fit, so both fail the probe there. Each row
    xq is cut into halves within [-64, 64] (`split_rows`), taken as u8 with zero point 64 (0..128, and
    128 x 127 twice fits). The kernel runs on the 2M rows with unit weight scales, so it returns their
    integer sums exactly as floats; a row's two sums added give float32(sum) rounded once, exactly the
    formula (`join_halves`; a block of at most SPLIT_COLUMNS columns keeps each sum below 2**24, and the
    blocks of a wider layer are added in float64). Twice the rows: a compute-bound prefill pays about
    twice the products, a memory-bound decode (the weights read once) little more.

    `raw` takes the halves and returns the sums (a wider layer's total in its first M rows, zeros in the
    rest, so `join_halves` still gives it): a layer splits and joins around it in its own forward, where
    torch.compile fuses both with the quantization and the scaling."""

    def split_pack(qweight: torch.Tensor, scale: torch.Tensor) -> _SplitPacking:
        k, ones = qweight.shape[1], torch.ones(qweight.shape[0])
        blocks = [(lo, min(k, lo + SPLIT_COLUMNS), pack(qweight[:, lo:lo + SPLIT_COLUMNS].contiguous(), ones))
                  for lo in range(0, k, SPLIT_COLUMNS)]
        return _SplitPacking(blocks, scale.float().contiguous())

    def raw(halves: torch.Tensor, packed: _SplitPacking) -> torch.Tensor:
        if len(packed.blocks) == 1:
            return halves_matmul(halves, packed.blocks[0][2])
        m, total = halves.shape[0] // 2, None
        for lo, hi, block in packed.blocks:
            y = halves_matmul(halves[:, lo:hi], block).double()
            total = y[:m] + y[m:] if total is None else total.add_(y[:m]).add_(y[m:])
        return torch.cat([total.float(), torch.zeros_like(total, dtype=torch.float32)])

    def matmul(xq: torch.Tensor, packed: _SplitPacking) -> torch.Tensor:
        return join_halves(raw(split_rows(xq), packed), packed.scale)

    return Int8Kernel(name, split_pack, matmul, packed_bytes, raw)


def _fbgemm_halves(halves: torch.Tensor, packed: Any) -> torch.Tensor:
    return _fbgemm_matmul(halves, packed, HALF_ZERO)  # fbgemm rounds its float input to the nearest integer


def _onednn_halves(halves: torch.Tensor, packed: Any) -> torch.Tensor:
    return _onednn_matmul(halves.round(), packed, _U8_HALF_ZERO)  # its u8 conversion would truncate


KERNELS: dict[str, Int8Kernel] = {  # in order of preference (measured; see the module docstring)
    "fbgemm": Int8Kernel("fbgemm", _fbgemm_pack, _fbgemm_matmul, lambda n, k: n * k + 8 * n),
    "onednn": Int8Kernel("onednn", _onednn_pack, _onednn_matmul, lambda n, k: n * k + 12 * n),
    "fbgemm-split": _split("fbgemm-split", _fbgemm_pack, _fbgemm_halves, lambda n, k: n * k + 12 * n),
    "onednn-split": _split("onednn-split", _onednn_pack, _onednn_halves, lambda n, k: n * k + 16 * n),
}


def exact_matmul(xq: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The formula in float64 (exact sums below 2**53), rounded like the kernels: the reference."""
    return (xq.double() @ qweight.double().t()).float() * scale


def _probe(kernel: Int8Kernel) -> str | None:
    """None when `kernel` computes the formula exactly, else why not. The probe saturates a 16-bit
    u8 x s8 pair sum (127 + 128 = 255 times 127, twice) and runs several row counts."""
    gen = torch.Generator().manual_seed(0)
    qweight = torch.randint(-QMAX, QMAX + 1, (40, 96), generator=gen, dtype=torch.int8)
    qweight[:8, :32] = QMAX
    scale = torch.rand(40, generator=gen) + 0.5
    try:
        packed = kernel.pack(qweight, scale)
        for rows in (1, 3, 17, 64):
            xq = torch.randint(-QMAX, QMAX + 1, (rows, 96), generator=gen).float()
            xq[0, :32] = QMAX
            got = kernel.matmul(xq, packed)
            if not torch.equal(got, exact_matmul(xq, qweight, scale)):
                return f"{kernel.name} int8 matmul is not exact on {rows} row(s) (16-bit saturation?)"
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return f"{kernel.name} int8 matmul unavailable: {type(e).__name__}: {str(e)[:200]}"
    return None


def choose_many_kernel(choice: str, few: Int8Kernel) -> Int8Kernel | None:
    """The kernel for products of MANY_ROWS rows and more beside `few` (a second packing), or None.
    `choice` "auto": oneDNN (its split form beside a split kernel) where the CPU has AMX tiles and it
    passes its probe; "off" (forced: EngineArgs.forced_kernel): none."""
    if choice == "off" or not _has_amx():
        return None
    # oneDNN, or its split form where its pairs saturate (not on a CPU with AMX, which has VNNI)
    return next((k for k in KERNELS.values() if k.name.startswith("onednn") and k is not few
                 and (k.raw is None) == (few.raw is None) and _probe(k) is None), None)


def _has_amx() -> bool:
    """Whether a second packing pays (`choose_many_kernel`): where the CPU has AMX tiles. Tests replace
    this check; the kernels' own choice of activation type reads `_amx_tiles` itself."""
    return _amx_tiles()


@functools.cache
def choose_kernel() -> Int8Kernel | str:
    """The first kernel in KERNELS that passes the probe, or (a string) why none does. Probed once
    per process (`choose_kernel.cache_clear()` probes again)."""
    reasons = []
    for kernel in KERNELS.values():
        why_not = _probe(kernel)
        if why_not is None:
            return kernel
        reasons.append(why_not)
        logger.debug("%s", why_not)
    return "; ".join(reasons)


# --------------------------------------------------------------------------------------------------
# modules


class Int8Linear(nn.Module):
    """A linear layer on int8 weights (packed for `kernel`; the int8 matrix itself is not kept).

    `input_scale` [in] (optional) multiplies the input per channel before it is quantized: smoothing
    (executor/cpu/quantization.py) stores the weight's columns multiplied by its inverse. `many`
    (optional) packs the weights a second time for products of MANY_ROWS rows and more."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: Int8Kernel,
                 input_scale: torch.Tensor | None = None, many: Int8Kernel | None = None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.kernel = kernel
        if many is not None and (many.raw is None) != (kernel.raw is None):
            raise ValueError(f"{kernel.name} and {many.name} take different inputs: one layer cannot use both")
        self.many = many
        self.register_buffer("weight_scale", scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().contiguous())
        self.packed = kernel.pack(qweight, self.weight_scale)
        self.packed_many = None if many is None else many.pack(qweight, self.weight_scale)

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: the packed int8 weight(s), its scales, the bias and input scales."""
        extra = sum(b.numel() * 4 for b in (self.bias, self.input_scale) if b is not None)
        packs = [k for k in (self.kernel, self.many) if k is not None]
        return sum(k.packed_bytes(self.out_features, self.in_features) for k in packs) + 4 * self.out_features + extra

    def product(self, xq: torch.Tensor) -> torch.Tensor:
        """float32(xq @ Wq.T) * w_scale for integral `xq` [M, in], on the packing its row count takes;
        on a split kernel, its sums over `xq`'s halves [2M, in] (`_split`)."""
        if self.kernel.raw is not None:
            if self.many is not None and xq.shape[0] >= 2 * MANY_ROWS:
                return self.many.raw(xq, self.packed_many)
            return self.kernel.raw(xq, self.packed)
        if self.many is not None and xq.shape[0] >= MANY_ROWS:
            return self.many.matmul(xq, self.packed_many)
        return self.kernel.matmul(xq, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.input_scale is not None:
            rows = rows * self.input_scale
        xq, s = quantize_rows(rows)
        split = self.kernel.raw is not None
        if split:
            xq = split_rows(xq)
        # the packed weights are opaque to torch.compile: an op finds them (executor/compiled_forward.py)
        compiling = torch.compiler.is_compiling()
        y = torch.ops.radixlm.int8_matmul(xq, self.weight_scale) if compiling else self.product(xq)
        y = (join_halves(y, self.weight_scale) if split else y).mul_(s)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        many = "" if self.many is None else f", {self.many.name} from {MANY_ROWS} rows"
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel.name}{many}"


class Int8Embedding(nn.Module):
    """Token embeddings stored as int8 rows with one scale per row (a tied lm_head packs the same rows).
    The rows may be mapped from a file (`map_rows`) rather than held: they are only read by lookups."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("weight_scale", scale.float().contiguous())
        self.mapped_from: str | None = None  # the file the rows are mapped from

    @property
    def mapped(self) -> bool:
        return self.mapped_from is not None

    def map_rows(self, rows: torch.Tensor, source: str) -> None:
        """Reads rows from `rows` (the same values, mapped from the file `source`); frees the held copy."""
        if rows.shape != self.qweight.shape or rows.dtype != torch.int8:
            raise ValueError(f"rows {tuple(rows.shape)} {rows.dtype} do not fit {tuple(self.qweight.shape)} int8")
        self.qweight = rows
        self.mapped_from = source

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float().mul_(self.weight_scale[ids].unsqueeze(-1))
