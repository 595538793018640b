"""A GGUF file's tensors, found without building its metadata.

gguf-py's reader turns every metadata value into numpy views, the tokenizer's ~100k strings
included: seconds for a small model. Loading weights needs only the architecture's name and the
tensor index, so this walks the metadata by its lengths and maps the tensor data read-only.
Layout (GGUF v2/v3): magic, version, tensor count, metadata count; the metadata (key, type, value);
the tensor infos (name, dims, ggml type, offset); data from the next multiple of the alignment.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
# (values, bytes) of a block of the types read here (ggml's block sizes): a row's length in bytes
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# The llama layout (llama, qwen2, qwen3 files): each GGUF name's checkpoint name, for the converter and
# for the int4 matmuls read straight from the file
LLAMA_LAYOUT = ("llama", "qwen2", "qwen3")
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
               "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    kind: str  # GGML_TYPES' name, or "type N"
    shape: tuple[int, ...]  # ggml order: the row length first
    data: np.ndarray  # uint8 [rows, row bytes] for block types, read-only


def read_gguf(path: Path) -> tuple[str, dict[str, Tensor]]:
    """(general.architecture, tensors by name)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(raw)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    pos, arch, alignment = 24, "", 32
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        if key == "general.architecture" and vtype == _STRING:
            arch, pos = _string(buf, pos)
        elif key == "general.alignment" and vtype == 4:
            (alignment,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        else:
            pos = _skip(buf, pos, vtype)
    infos = []
    for _ in range(n_tensors):
        name, pos = _string(buf, pos)
        (dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        shape = struct.unpack_from(f"<{dims}Q", buf, pos)
        pos += 8 * dims
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((name, GGML_TYPES.get(kind, f"type {kind}"), tuple(shape), offset))
    start = (pos + alignment - 1) // alignment * alignment
    tensors = {}
    for name, kind, shape, offset in infos:
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        if kind in BLOCKS:
            values, nbytes = BLOCKS[kind]
            width = shape[0] // values * nbytes
        elif kind in ("F32", "F16", "BF16"):
            width = shape[0] * (4 if kind == "F32" else 2)
        else:
            width = 0  # a type not read here: indexed, no data
        data = raw[start + offset : start + offset + rows * width].reshape(rows, width) if width else raw[:0]
        tensors[name] = Tensor(name, kind, shape, data)
    return arch, tensors


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n


def _skip(buf: memoryview, pos: int, vtype: int) -> int:
    if vtype in _SCALARS:
        return pos + struct.calcsize(_SCALARS[vtype])
    if vtype == _STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if vtype == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALARS:
            return pos + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):
            pos = _skip(buf, pos, item)
        return pos
    raise ValueError(f"unknown GGUF metadata type {vtype}")


def checkpoint_name(gguf_name: str) -> str | None:
    """'model.layers.3.self_attn.q_proj.weight' for 'blk.3.attn_q.weight' (the llama layout); None for a
    name not mapped."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base.startswith("blk."):
        _, index, part = base.split(".", 2)
        return f"model.layers.{index}.{LAYER_NAMES[part]}.{suffix}" if part in LAYER_NAMES and index.isdigit() else None
    return f"{TOP_NAMES[base]}.{suffix}" if base in TOP_NAMES else None


def permuted_heads(arch: str, gguf_name: str, config) -> int | None:
    """The head count whose rotary halves llama.cpp's converter interleaved in this tensor's rows (only a
    llama's q and k, weights and biases), or None where the rows are as the checkpoint has them."""
    part = gguf_name.split(".")[2] if arch == "llama" and gguf_name.startswith("blk.") else ""
    heads = config.num_attention_heads
    if part == "attn_q":
        return heads
    return (getattr(config, "num_key_value_heads", None) or heads) if part == "attn_k" else None


def unpermute_rows(rows, heads: int):
    """llama.cpp's converter interleaves each head's rotary halves in a llama's q and k; undo it on rows
    (a numpy array or a torch tensor, rows first)."""
    per = rows.shape[0] // heads // 2
    return rows.reshape(heads, per, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
