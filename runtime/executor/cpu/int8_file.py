"""The int8 cache file's reading, writing and mapping (`quantization.py` names it and decides what
goes in). Written atomically (a temp file renamed into place, never rewritten), so a mapping of it
never sees it change; the token embeddings' rows are mapped from it rather than held in memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import uuid
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.executor.cache_prune import SOURCE_META, prune_quantized
from radixlm.runtime.executor.cpu.int8 import Int8Embedding

logger = logging.getLogger(__name__)

_META_KEY = "radixlm_quantized"  # the file's metadata entry holding its cache key


def read_cache(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The file's tensors, or None when it is absent, unreadable or written for another key."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get(_META_KEY) != key:
                logger.warning("quantized cache %s was written for another source (%s); rebuilding",
                               path, meta.get(_META_KEY))
                return None
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a damaged file
        logger.warning("quantized cache %s is unreadable (%s: %s); rebuilding", path, type(e).__name__, e)
        return None


def mapped_resident_bytes(model: nn.Module) -> int | None:
    """Bytes of the model's mapped embedding rows now resident in this process (pages of rows looked
    up so far, and the kernel's neighbours of them); None where /proc/self/smaps cannot tell."""
    from radixlm.runtime.executor.cpu.gguf_embedding import GgufQ8Embedding

    files = {m.mapped_from for m in model.modules() if isinstance(m, Int8Embedding) and m.mapped}
    files |= {m.mapped_from for m in model.modules() if isinstance(m, GgufQ8Embedding)}
    try:
        with open("/proc/self/smaps") as fh:
            lines = fh.readlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):  # a mapping's first line ends with its file
            inside = line.rstrip().split(maxsplit=5)[-1] in files
        elif inside and head == "Rss:":
            total += int(line.split()[1]) * 1024
    return total


def map_tensor(path: Path, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The int8 tensor `name` of the safetensors file at `path`, mapped on its own (copy-on-write, so
    nothing is ever written back): pages are read when first touched. ValueError when the file does
    not hold it with that shape."""
    import numpy as np

    with open(path, "rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        if header_len > 100 * 2**20:  # safetensors' own limit on a header
            raise ValueError(f"{path}: header of {header_len} bytes")
        entry = json.loads(fh.read(header_len)).get(name)
        size = os.fstat(fh.fileno()).st_size
    if not entry or entry.get("dtype") != "I8" or tuple(entry.get("shape", ())) != shape:
        raise ValueError(f"{path}: no int8 tensor {name} of shape {shape}")
    begin, end = entry["data_offsets"]
    offset = 8 + header_len + begin
    if end - begin != int(np.prod(shape)) or offset + end - begin > size:
        raise ValueError(f"{path}: {name} lies outside the file")
    return torch.from_numpy(np.memmap(path, dtype=np.int8, mode="c", offset=offset, shape=shape))


def map_embeddings(model: nn.Module, path: Path) -> int:
    """Points every Int8Embedding's rows at the (valid) cache file `path` instead of memory; returns
    the bytes now mapped. An embedding the file cannot give keeps its rows in memory (logged)."""
    mapped = 0
    for name, module in model.named_modules():
        if not isinstance(module, Int8Embedding) or module.mapped:
            continue
        try:
            rows = map_tensor(path, f"{name}.qweight", tuple(module.qweight.shape))
        except (OSError, ValueError) as e:
            logger.warning("token embeddings stay in memory: cannot map them from %s (%s)", path, e)
            module.qweight = module.qweight.clone()  # let go of the whole file's mapping
            continue
        module.map_rows(rows, str(path.resolve()))
        mapped += rows.numel()
    return mapped


def write_cache(path: Path, key: str, tensors: dict[str, torch.Tensor], source: Path) -> bool:
    """Writes atomically (a temp file renamed into place), recording the `source` folder; False
    (logged) when the folder is not writable. Then removes the files this one replaces
    (`cache_prune.prune_quantized`)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"format": "pt", _META_KEY: key, SOURCE_META: str(source)})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # the folder may be what failed
            tmp.unlink(missing_ok=True)
        logger.warning("cannot write the quantized cache %s: %s (the next start quantizes again)", path, e)
        return False
    try:  # never fails a load
        prune_quantized(path, source, prefix=path.name.rsplit("-", 1)[0] + "-")
    except OSError as e:
        logger.warning("could not prune old int8 cache files beside %s: %s", path, e)
    return True


def mapped_weight_bytes(model: nn.Module) -> int:
    """Bytes of embedding rows mapped from a file (the int8 cache, a GGUF): resident only where looked up."""
    from radixlm.runtime.executor.cpu.gguf_embedding import GgufQ8Embedding

    return sum(m.qweight.numel() for m in model.modules() if isinstance(m, Int8Embedding) and m.mapped) + \
        sum(m.rows.numel() for m in model.modules() if isinstance(m, GgufQ8Embedding))
