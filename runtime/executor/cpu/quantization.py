"""Quantized weights at load (`--quantization`), cached beside the float conversion.

`resolve_quantization` turns the option into a mode ("none", "int8", "fp16" or "int4") for a device,
a dtype and the model's file. fp16 (weights only, `cpu/fp16.py`) and int4 (`cpu/int4.py`) are
conversions at load and have no cache file.
`load_quantized` fills a freshly built model in that mode: every matmul weight (lm_head included) and
the token embeddings become int8 with per-channel scales (`cpu/int8.py` has the
numbers and the kernels); norms and biases stay float32.

Smoothing: per-token int8 activations lose much on a small model, because a few input channels carry
values 50-2,000x the median. Before quantizing, the weights of every decoder-layer Linear are
multiplied per input column by c = amax_x ** alpha / amax_w ** (1 - alpha) and the layer divides its
input by c (`Int8Linear.input_scale`), which leaves the float product unchanged and spreads the
outliers' range over activations and weights (SmoothQuant, arXiv 2211.10438). amax_x comes from one
float32 prefill of a fixed text (`executor/cpu/calibration.py`); alpha = `SMOOTH_ALPHA` was picked with
`benchmarks/quality.py`. The lm_head is not smoothed (it scores slightly better without). At load
the division moves upstream where the model says it can (`input_scale_folds`: into the norm before
qkv and gate_up, into up's weight scales before down), one elementwise op fewer per fold per layer;
the cache file keeps the input scales as computed.

The int8 tensors are kept in one safetensors file under `<cache>/quantized/`, named by the source
folder, the mode and a digest of the source weights (paths, sizes, mtimes), the model class, the
calibration and the attention backend it ran on, and `_FORMAT_VERSION`, and
written atomically like the GGUF conversion; a restart reads that file (134 MB for SmolLM2-135M)
instead of the float32 weights and quantizes nothing. A file that cannot be read, does not match its
key, or does not fit the model is rebuilt.

Token embeddings are only ever read a row at a time (the lm_head packs its own copy), so once the file
is valid their int8 rows are not kept in memory: they are mapped from it (`map_embeddings`), and only
the pages of tokens actually looked up become resident; those pages are clean (the kernel can drop
and reread them) and shared by every process serving the same file. Files are only ever replaced by
renaming, never rewritten in place, so a mapping never sees a file change under it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.engine_args import QUANTIZATION_CHOICES
from radixlm.runtime.executor.cpu.calibration import CALIBRATION_TEXT, input_channel_max
from radixlm.runtime.executor.cpu.fp16 import Fp16Embedding, Fp16Linear, fp16_unavailable
from radixlm.runtime.executor.cpu.int4 import Int4Linear, int4_unavailable
from radixlm.runtime.executor.cpu.int8 import (
    MANY_ROWS,
    Int8Embedding,
    Int8Kernel,
    Int8Linear,
    choose_kernel,
    choose_many_kernel,
    quantize_weight,
)
from radixlm.runtime.executor.cpu.int8_file import map_embeddings, read_cache, write_cache

logger = logging.getLogger(__name__)

# Bump when the file's names or numbers change: the quantization, the smoothing, or the calibration
# prefill's arithmetic (attention, norms, matmuls) in a way that moves the last bits of an activation.
_FORMAT_VERSION = 2
SMOOTH_ALPHA = 0.6  # how much of an input channel's range moves into the weights (0: none, 1: all)
_UNSMOOTHED = ("lm_head",)
CALIBRATION_WINDOW = 1024  # tokens per calibration prefill (the text is ~960 tokens with SmolLM2's tokenizer)


@dataclass(frozen=True, slots=True)
class QuantizedLoad:
    """What `load_quantized` did: the mode, the kernel, the cache file, whether it was reused, seconds spent."""

    mode: str
    kernel: str
    path: Path
    reused: bool
    seconds: float


def resolve_quantization(choice: str, device: torch.device, dtype: torch.dtype, float_matmuls: bool = False,
                         file_4bit: bool = False) -> str:
    """`choice` itself, after checking it can run here: ValueError for int8, fp16 or int4 off the CPU,
    on a model that is not float32, or where no kernel of the mode passes its probe.

    "auto" (the default) on the CPU: int4 where the model came from a GGUF whose matmuls are 4-bit
    blocks (`file_4bit`: the built-in model), run on the file's own numbers as llama.cpp does; else
    fp16, which fbgemm runs within 0.1% of float32's perplexity (`benchmarks/quality.py`). Neither
    where `float_matmuls` says the answers must not depend on the batch (deterministic inference):
    fp16's kernel rounds a row by how many rows share its product, and int4's rows are bfloat16, which
    turns the last-bit differences of another schedule or cache state (the attention's) into a few
    hundredths of a logprob, enough to flip a near-tie; float32 ("none") there and off the CPU."""
    if choice not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {choice!r}")
    if choice == "auto":
        if device.type != "cpu" or dtype != torch.float32 or float_matmuls:
            return "none"
        if file_4bit and int4_unavailable() is None:
            return "int4"
        return "fp16" if fp16_unavailable() is None else "none"
    if choice == "none":
        return "none"
    if device.type != "cpu" or dtype != torch.float32:
        this = f"{str(dtype).removeprefix('torch.')} on {device}"
        why_not = f"{choice} runs float32 models on the CPU (this one is {this})"
    elif choice == "fp16":
        why_not = fp16_unavailable()
    elif choice == "int4":
        why_not = int4_unavailable()
        if why_not is None and float_matmuls:
            why_not = "its bfloat16 kernel's rounding is not proven batch-invariant (deterministic inference)"
    else:
        kernel = choose_kernel()
        why_not = kernel if isinstance(kernel, str) else None
    if why_not is not None:
        raise ValueError(f"quantization {choice!r} cannot be used: {why_not}")
    return choice


# --------------------------------------------------------------------------------------------------
# model <-> quantized tensors


def _quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> the Linear / Embedding modules whose weights are stored as int8."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}


def _tied_head(model: nn.Module) -> bool:
    """A model whose logits reuse the embedding matrix gets its own packed copy as `lm_head`."""
    return bool(getattr(model, "tie_word_embeddings", False)) and getattr(model, "lm_head", None) is None


def smoothing(input_max: torch.Tensor, weight: torch.Tensor, alpha: float | None = None) -> torch.Tensor:
    """c [in]: the factor each weight column is multiplied by (and each input channel divided by)."""
    alpha = SMOOTH_ALPHA if alpha is None else alpha
    weight_max = weight.detach().float().abs().amax(dim=0)
    return input_max.clamp_min(1e-5).pow(alpha) / weight_max.clamp_min(1e-5).pow(1 - alpha)


def quantize_state(model: nn.Module, input_max: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights (loaded, float) as the cache file holds them: `<module>.qweight` (int8) and
    `<module>.weight_scale` for every Linear and Embedding, `<module>.input_scale` for the Linears
    smoothed with `input_max` (module name -> max |input| per channel), every other parameter as float32."""
    tensors: dict[str, torch.Tensor] = {}
    covered: set[str] = set()
    for name, module in _quantized_modules(model).items():
        weight = module.weight.detach().float()
        if input_max and name in input_max and name not in _UNSMOOTHED:
            c = smoothing(input_max[name], weight)
            weight = weight * c
            tensors[f"{name}.input_scale"] = c.reciprocal()
        tensors[f"{name}.qweight"], tensors[f"{name}.weight_scale"] = quantize_weight(weight)
        covered.add(f"{name}.weight")
    for name, param in model.named_parameters():
        if name not in covered:
            tensors[name] = param.detach().float().contiguous()
    return tensors


class QuantizedStateError(ValueError):
    """Quantized tensors that do not fit the model (a stale or foreign cache file)."""


def _take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    tensor = tensors.get(name)
    if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != dtype:
        got = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
        raise QuantizedStateError(f"{name}: expected {shape} {dtype}, found {got}")
    return tensor


def apply_quantized(model: nn.Module, tensors: dict[str, torch.Tensor], kernel: Int8Kernel,
                    many: Int8Kernel | None = None) -> None:
    """Swaps the model's Linear / Embedding modules for int8 ones built from `tensors` (as written by
    `quantize_state`), packed for `kernel` (and `many`, see Int8Linear), and sets every other
    parameter. Checks everything before it changes anything: tensors that do not fit raise
    QuantizedStateError and leave the model as it was."""
    modules = _quantized_modules(model)
    quantized_weights = {f"{n}.weight" for n in modules}
    params = {n: p for n, p in model.named_parameters() if n not in quantized_weights}
    expected = {f"{n}.{part}" for n in modules for part in ("qweight", "weight_scale")} | set(params)
    optional = {f"{n}.input_scale" for n, m in modules.items() if isinstance(m, nn.Linear)}
    if not expected <= set(tensors) <= expected | optional:
        extra, missing = sorted(set(tensors) - expected - optional), sorted(expected - set(tensors))
        raise QuantizedStateError(
            f"tensors do not fit {type(model).__name__}: missing {missing[:3]}, extra {extra[:3]}")
    # clone what is kept: tensors read from the cache file map it, and one kept view would keep every
    # page of it resident (the packed weights are copies already). Embedding rows are the exception:
    # `map_embeddings` maps them on their own next (or copies them where it cannot)
    values = {n: _take(tensors, n, tuple(p.shape), torch.float32).clone() for n, p in params.items()}
    scales = {n: _take(tensors, f"{n}.weight_scale", (m.weight.shape[0],), torch.float32).clone()
              for n, m in modules.items()}
    input_scales = {n: _take(tensors, f"{n}.input_scale", (m.weight.shape[1],), torch.float32).clone()
                    for n, m in modules.items() if f"{n}.input_scale" in tensors}
    _fold_input_scales(model, input_scales, values, scales)
    new: dict[str, nn.Module] = {}
    for name, module in modules.items():
        out, in_ = module.weight.shape
        qweight = _take(tensors, f"{name}.qweight", (out, in_), torch.int8)
        if isinstance(module, nn.Embedding):
            new[name] = Int8Embedding(qweight, scales[name])
            if name == "embed_tokens" and _tied_head(model):
                new["lm_head"] = Int8Linear(qweight, scales[name], None, kernel, many=many)
        else:
            bias = None if module.bias is None else values[f"{name}.bias"]
            new[name] = Int8Linear(qweight, scales[name], bias, kernel, input_scales.get(name), many)
    for name, param in params.items():
        param.data = values[name]
    for name, module in new.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)


def _fold_input_scales(model: nn.Module, input_scales: dict[str, torch.Tensor], values: dict[str, torch.Tensor],
                       scales: dict[str, torch.Tensor]) -> None:
    """Applies the input scales the model says can be applied upstream (`input_scale_folds`) there:
    into a norm's weight, or into the weight scales of the output rows that feed the input, with no
    bias on them (a bias would be scaled too). Each fold removes one elementwise op from a decode
    layer; the product it computes is the same up to float rounding. Removes folded entries."""
    for name, (target, rows) in getattr(model, "input_scale_folds", dict)().items():
        scale = input_scales.get(name)
        if scale is None:
            continue
        if rows is None:
            values[target] = values[target] * scale
        elif f"{target}.bias" not in values:
            scales[target][rows] *= scale
        else:
            continue
        del input_scales[name]


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights held in memory (packed int8 where quantized); embedding rows
    mapped from the cache file are left out (`mapped_weight_bytes`)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, (Int8Linear, Fp16Linear, Int4Linear)):
            total += module.nbytes
        elif isinstance(module, Fp16Embedding):
            total += module.bits.numel() * 2
        elif isinstance(module, Int8Embedding):
            total += module.weight_scale.numel() * 4 + (0 if module.mapped else module.qweight.numel())
    return total


# --------------------------------------------------------------------------------------------------
# the cache file


def cache_path(folder: Path, mode: str, model: nn.Module, cache_dir: Path,
               calibrated_on: str = "torch") -> tuple[Path, str]:
    """(file, key): the key covers the source weights (path, size, mtime of each safetensors file and
    of tokenizer.json, which tokenizes the calibration text), the mode, the model class, the
    smoothing (alpha, calibration text, the attention backend the calibration ran on) and the format
    version (not the code's text: a comment edited must not discard every user's cache)."""
    folder = folder.resolve()
    calibration = hashlib.sha256(CALIBRATION_TEXT.encode()).hexdigest()[:16]
    parts = [f"v{_FORMAT_VERSION}", mode, type(model).__name__, str(folder), f"{SMOOTH_ALPHA}:{calibration}",
             f"attention:{calibrated_on}"]
    for file in sorted([*folder.glob("*.safetensors"), *folder.glob("tokenizer.json")]):
        st = file.stat()
        parts.append(f"{file.name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return cache_dir / "quantized" / f"{folder.name}-{mode}-{key}.safetensors", key


def load_quantized(model: nn.Module, folder: Path, mode: str, cache_dir: Path, tokenizer, attn_backend,
                   context_len: int, batch_packing: str = "auto") -> QuantizedLoad:
    """Fills `model` (just built, weights not loaded) with int8 weights: from the cache file when it
    is valid, else from the float weights in `folder`, smoothed with statistics of prefills of the
    calibration text (on `attn_backend`, `context_len` tokens at most each), quantized now and cached
    for the next start. `batch_packing` (auto | off): whether a second packing runs products of
    MANY_ROWS rows and more (`choose_many_kernel`)."""
    from radixlm.runtime.executor.loader import load_weights

    if mode != "int8":
        raise ValueError(f"no quantized weights for mode {mode!r}")
    kernel = choose_kernel()
    if isinstance(kernel, str):
        raise ValueError(f"quantization 'int8' cannot be used: {kernel}")
    many = choose_many_kernel(batch_packing, kernel)
    name = kernel.name if many is None else f"{kernel.name}, {many.name} from {MANY_ROWS} rows"
    start = time.perf_counter()
    path, key = cache_path(folder, mode, model, cache_dir, attn_backend.name)
    tensors = read_cache(path, key)
    if tensors is not None:
        try:
            apply_quantized(model, tensors, kernel, many)
            del tensors  # drops safetensors' mapping of the whole file, with the pages packing read
            map_embeddings(model, path)
            return QuantizedLoad(mode, name, path, True, time.perf_counter() - start)
        except QuantizedStateError as e:
            logger.warning("quantized cache %s does not fit the model (%s); rebuilding", path, e)
    model.load_weights(load_weights(folder, torch.float32, "cpu"))
    with torch.inference_mode():
        ids = tokenizer(CALIBRATION_TEXT).input_ids
        input_max = input_channel_max(model, attn_backend, ids, window=min(CALIBRATION_WINDOW, context_len))
    tensors = quantize_state(model, input_max)
    written = write_cache(path, key, tensors, source=folder.resolve())
    apply_quantized(model, tensors, kernel, many)
    if written:  # else the rows stay in `tensors`' memory
        map_embeddings(model, path)
    return QuantizedLoad(mode, name, path, False, time.perf_counter() - start)
