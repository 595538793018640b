"""A GGUF file dequantized into a float32 safetensors folder with transformers (run once per file;
loader.py caches the folder and decides when to convert)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"

_QUANT_RE = re.compile(r"(?i)[.\-_](I?Q\d[A-Z0-9_]*|BF16|F16|F32)$")


def gguf_label(path: Path) -> str:
    """'GGUF Q4_1' from a name like 'SmolLM2-135M-Instruct.Q4_1.gguf' (just 'GGUF' if unknown)."""
    match = _QUANT_RE.search(path.stem)
    return f"GGUF {match.group(1).upper()}" if match else "GGUF"


# --------------------------------------------------------------------------------------------------
# GGUF -> cached safetensors folder


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and write config, generation config, tokenizer (with
    its chat template) and float32 safetensors weights into ``out_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=name, config=config, dtype=torch.float32, local_files_only=True
    )

    # The model is flagged as gguf-quantized, which save_pretrained refuses; write the parts ourselves.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

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
    # Make sure everything is on disk before the folder is renamed into place.
    for item in out_dir.iterdir():
        if item.is_file():
            os.chmod(item, 0o644)  # safetensors writes 0600; the cache is plain readable data
            with open(item, "rb") as fh:
                os.fsync(fh.fileno())
