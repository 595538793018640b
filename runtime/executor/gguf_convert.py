"""A GGUF file dequantized into a float32 safetensors folder (run once per file; loader.py caches the
folder and decides when to convert).

The config and the tokenizer (with its chat template) come from transformers' GGUF readers. The
weights of the architectures whose tensor names are mapped here (llama, qwen2, qwen3: most GGUF files
people run) are dequantized with gguf-py a tensor at a time and written straight into the safetensors
file, so memory holds one tensor, not the model (a 7B file is 28 GB of float32). Other architectures
go through transformers' model loader, which builds the whole float32 model first.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from radixlm.runtime.executor.gguf_tensors import (
    BLOCKS,
    LLAMA_LAYOUT,
    Tensor,
    checkpoint_name,
    permuted_heads,
    read_gguf,
    unpermute_rows,
)

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"

_QUANT_RE = re.compile(r"(?i)[.\-_](I?Q\d[A-Z0-9_]*|BF16|F16|F32)$")

_UNUSED = ("rope_freqs.weight",)  # Llama 3's rope factors: the config carries its rope scaling


def gguf_label(path: Path) -> str:
    """'GGUF Q4_1' from a name like 'SmolLM2-135M-Instruct.Q4_1.gguf' (just 'GGUF' if unknown)."""
    match = _QUANT_RE.search(path.stem)
    return f"GGUF {match.group(1).upper()}" if match else "GGUF"


# --------------------------------------------------------------------------------------------------
# GGUF -> cached safetensors folder


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write ``gguf``'s config, generation config, tokenizer (with its chat template) and float32
    safetensors weights into ``out_dir``."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    src_dir, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    arch, tensors = read_gguf(gguf)
    streamed = _streamed(arch, tensors, config)
    if streamed is None:
        _write_through_transformers(gguf, out_dir, config)
    else:
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.tie_word_embeddings = "output.weight" not in tensors
        config.dtype = "float32"
        config.save_pretrained(out_dir)
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
        write_safetensors(out_dir / WEIGHTS_FILE, streamed)
    AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True).save_pretrained(out_dir)
    # Make sure everything is on disk before the folder is renamed into place.
    for item in out_dir.iterdir():
        if item.is_file():
            os.chmod(item, 0o644)  # safetensors writes 0600; the cache is plain readable data
            with open(item, "rb") as fh:
                os.fsync(fh.fileno())


Planned = list[tuple[str, tuple[int, ...], Callable[[], np.ndarray]]]


def _streamed(arch: str, tensors: dict[str, Tensor], config) -> Planned | None:
    """(checkpoint name, shape, its float32 values when called) for every tensor of the file, or None
    where a name, a type or the architecture is not one read here."""
    from gguf import GGMLQuantizationType

    if arch not in LLAMA_LAYOUT:
        return None
    planned: Planned = []
    for t in tensors.values():
        if t.name in _UNUSED:
            continue
        hf = checkpoint_name(t.name)
        if hf is None or (t.kind not in BLOCKS and t.kind not in ("F32", "F16", "BF16")):
            logger.debug("%s (%s) is not read here: transformers converts the file", t.name, t.kind)
            return None
        heads_of = permuted_heads(arch, t.name, config)
        shape = tuple(reversed(t.shape))

        def values(t=t, shape=shape, heads_of=heads_of) -> np.ndarray:
            w = _dequantize(t.data, GGMLQuantizationType[t.kind]).reshape(shape)
            return w if heads_of is None else unpermute_rows(w, heads_of)

        planned.append((hf, shape, values))
    return planned


def _dequantize(data: np.ndarray, kind) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(data, kind).astype(np.float32, copy=False)


def write_safetensors(path: Path, planned: Planned) -> None:
    """A float32 safetensors file written a tensor at a time: the header first (every shape is known),
    then each tensor's values as they are made."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in planned:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, values in planned:
            w = np.ascontiguousarray(values(), dtype="<f4")
            if w.shape != shape:
                raise ValueError(f"{name}: {w.shape} values for a {shape} tensor")
            f.write(memoryview(w).cast("B"))


def _write_through_transformers(gguf: Path, out_dir: Path, config) -> None:
    """The weights by transformers' GGUF loader (every architecture it reads), with the config as the
    loaded model has it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                                 dtype=torch.float32, local_files_only=True)
    # The model is flagged as gguf-quantized, which save_pretrained refuses; write the parts ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for tensor_name, tensor in model.state_dict().items():
        # Tied parameters (lm_head <- embed_tokens) appear twice; keep the first name like save_pretrained.
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ident in seen:
            logger.debug("skipping %s: tied to %s", tensor_name, seen[ident])
            continue
        seen[ident] = tensor_name
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32)
        tensors[tensor_name] = tensor.detach().contiguous()
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
