"""The KV snapshot file: the hottest part of the radix cache, as one safetensors file.

Any safetensors reader opens it. Tensors: `k.{layer}` / `v.{layer}` `[rows, kv_heads, head_dim]` in the
KV pool's dtype, `tokens` int64 `[rows]` (the token of each row), and per node, int64 `[nodes]`:
`parents` (index of the parent node, -1 for the root; parents come first), `lengths` (rows of its
edge: node i owns the `lengths[i]` rows after those of nodes 0..i-1), `hits`, and uint8 `valid`
(0: the node left the cache while it was being saved and holds nothing usable). `__metadata__`
holds `format`, `version`, `fingerprint` (JSON: what produced the K/V, see snapshot.py) and
`checksum`, an xxh3-128 of the other metadata and every data byte.

Written atomically: data go to a temporary file beside the target, the header last (its size is
fixed up front, the checksum included), then fsync, rename over the target and fsync of the folder:
a crash at any point leaves the previous snapshot whole. Read: everything is checked (format,
fingerprint, sizes against the file's length, node table, checksum) before a single row is used;
any failure is a SnapshotError naming it.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch
import xxhash

FORMAT, VERSION = "radixlm-kv-snapshot", "1"
CHUNK_ROWS = 4096  # rows gathered per piece (bounded memory while saving)
MIN_DIRECT_RUN = 16  # runs of consecutive slots at least this long are written straight from the pool
MAX_HEADER_BYTES = 1 << 24
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
           torch.uint8: "U8"}
_CHECKSUM_PLACEHOLDER = "0" * 32
WEIGHT_SAMPLES = 4096  # values of each weight tensor that go into the fingerprint
_VOLATILE_CONFIG = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash")


class SnapshotError(Exception):
    """A snapshot that cannot be used or made; the message says why. `kind`: "refused" (a file that
    does not fit this server or is not whole), "busy" (a save or load is in flight), "unconfigured"
    (no file named), "disabled" (no radix cache), "failed" (the disk said no)."""

    def __init__(self, message: str, kind: str = "refused") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class SnapshotData:
    """A verified snapshot: node table and rows (views into the mapped file, kept open by `_map`)."""

    parents: list[int]
    lengths: list[int]
    hits: list[int]
    valid: list[bool]
    tokens: torch.Tensor
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    _map: mmap.mmap | None = None

    def close(self) -> None:
        self.k = self.v = []
        self.tokens = torch.empty(0, dtype=torch.int64)
        if self._map is not None:
            _close(self._map)
            self._map = None


def fingerprint(runner, args) -> dict[str, str]:
    """What produced a pool's K/V: RadixLM version, model weights (a digest of a strided sample of
    every tensor: cheap at start-up, and any fine-tune or conversion changes it), model config,
    dtype, tokenizer, KV layout, device type and matmul kernels. Servers with equal fingerprints
    compute the same K/V bits for the same tokens."""
    weights = xxhash.xxh3_128()
    for name, t in sorted(runner.model.state_dict().items()):
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // WEIGHT_SAMPLES)][:WEIGHT_SAMPLES].contiguous().cpu()
        weights.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        weights.update(sample.view(torch.uint8).numpy().tobytes())
    config = {k: v for k, v in runner.config.to_dict().items() if k not in _VOLATILE_CONFIG}
    tok = runner.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    try:
        version = metadata.version("radixlm")
    except metadata.PackageNotFoundError:
        version = "unknown"
    pool = runner.kv_pool
    return {
        "radixlm": version,
        "model_weights": weights.hexdigest(),
        "model_config": xxhash.xxh3_128(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "tokenizer": xxhash.xxh3_128(f"{type(tok).__name__}\n{vocab}".encode()).hexdigest(),
        "kv_layout": f"{len(pool.k)} layers x {tuple(pool.k[0].shape[1:])}",
        "device": runner.device.type,
        # the mode the runner resolved ("auto" names none)
        "kernels": f"gemm={getattr(runner, 'gemm', None)} "
                   f"quantization={getattr(runner, 'quantization', None) or getattr(args, 'quantization', None)}",
    }


def _layout(num_layers: int, rows: int, nodes: int, kv_shape: tuple[int, int], kv_dtype: torch.dtype):
    """(name, dtype, shape) of every tensor, in file order."""
    out = []
    for layer in range(num_layers):
        out += [(f"k.{layer}", kv_dtype, (rows, *kv_shape)), (f"v.{layer}", kv_dtype, (rows, *kv_shape))]
    out += [("tokens", torch.int64, (rows,))]
    out += [(name, torch.int64, (nodes,)) for name in ("parents", "lengths", "hits")]
    return out + [("valid", torch.uint8, (nodes,))]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()


def _header(layout, metadata: dict[str, str]) -> bytes:
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in layout:
        size = _nbytes(dtype, shape)
        entries[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header with spaces to 8 bytes


def _signed_part(metadata: dict[str, str]) -> bytes:
    return json.dumps({k: v for k, v in metadata.items() if k != "checksum"}, sort_keys=True).encode()


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _pieces(slots: torch.Tensor) -> Iterator[tuple[int, int, bool]]:
    """(first row, end row, direct) covering all rows: long runs of consecutive slots are read
    straight from the pool; short ones are gathered together, CHUNK_ROWS at most per piece."""
    n = len(slots)
    if n == 0:
        return
    cuts = [0, *((slots[1:] - slots[:-1] != 1).nonzero().flatten() + 1).tolist(), n]
    pending = None
    for a, b in zip(cuts, cuts[1:]):
        if b - a >= MIN_DIRECT_RUN:
            if pending is not None:
                yield pending, a, False
                pending = None
            yield a, b, True
        elif pending is None:
            pending = a
        elif b - pending > CHUNK_ROWS:
            yield pending, a, False
            pending = a
    if pending is not None:
        yield pending, n, False


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _not_regular(mode: int) -> SnapshotError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return SnapshotError(f"it is {kind}, not a regular file: a snapshot is only read from or written to a "
                         "regular file")


def _open_regular(path: Path) -> int:
    """A read descriptor of the regular file at `path`, or SnapshotError. Checked before opening (a
    device is never opened), opened non-blocking (a FIFO swapped in meanwhile does not wait for a
    writer) and checked again on the descriptor (what was opened is what was checked)."""
    try:
        before = os.stat(path)
    except OSError as e:
        raise SnapshotError(f"cannot open it: {e.strerror or e}") from e
    if not stat.S_ISREG(before.st_mode):
        raise _not_regular(before.st_mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SnapshotError(f"cannot open it: {e.strerror or e}") from e
    after = os.fstat(fd)
    if not stat.S_ISREG(after.st_mode) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise _not_regular(after.st_mode) if not stat.S_ISREG(after.st_mode) else \
            SnapshotError("it was replaced while it was opened; try again")
    os.set_blocking(fd, True)
    return fd


def check_target(path: Path) -> None:
    """SnapshotError when `path` exists and is not a regular file (a save never replaces a device,
    a FIFO or a directory); a symlink is judged by what it points to."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise SnapshotError(f"cannot write it: {e.strerror or e}", "failed") from e
    if not stat.S_ISREG(mode):
        raise _not_regular(mode)


def write_snapshot(path: Path, pool_k: list[torch.Tensor], pool_v: list[torch.Tensor], slots: torch.Tensor,
                   node_table: dict[str, torch.Tensor], fingerprint: dict, check_valid: Callable[[], list[bool]]
                   ) -> dict:
    """Writes the rows of `slots` from the pool tensors, then `node_table` (tokens, parents, lengths,
    hits) and the `valid` flags that `check_valid()` returns once every row was read (it decides which
    nodes stayed in the cache meanwhile, so which rows are sound). Atomic; returns figures."""
    rows, nodes = len(slots), len(node_table["parents"])
    kv_shape, kv_dtype = tuple(pool_k[0].shape[1:]), pool_k[0].dtype
    layout = _layout(len(pool_k), rows, nodes, kv_shape, kv_dtype)
    metadata = {"format": FORMAT, "version": VERSION, "fingerprint": json.dumps(fingerprint, sort_keys=True),
                "checksum": _CHECKSUM_PLACEHOLDER}
    header = _header(layout, metadata)
    path = Path(path)
    check_target(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    hasher = xxhash.xxh3_128()
    hasher.update(_signed_part(metadata))
    slots_dev = slots.to(pool_k[0].device)
    pieces = list(_pieces(slots)) if not pool_k[0].is_cuda else \
        [(a, min(a + CHUNK_ROWS, rows), False) for a in range(0, rows, CHUNK_ROWS)]
    try:
        # a new file of our own (O_EXCL: never one an attacker placed at the temporary name)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        with open(os.open(tmp, flags, 0o644), "wb") as f:
            f.seek(8 + len(header))
            for k, v in zip(pool_k, pool_v):
                for src in (k, v):
                    for a, b, direct in pieces:
                        if direct:
                            s0 = int(slots[a])
                            piece = src[s0 : s0 + (b - a)]
                        else:
                            piece = src.index_select(0, slots_dev[a:b])
                        data = _as_bytes(piece.cpu())
                        f.write(data)
                        hasher.update(data)
            valid = torch.tensor(check_valid(), dtype=torch.uint8)
            for t in (node_table["tokens"], node_table["parents"], node_table["lengths"], node_table["hits"], valid):
                data = _as_bytes(t)
                f.write(data)
                hasher.update(data)
            metadata["checksum"] = hasher.hexdigest()
            final = _header(layout, metadata)
            assert len(final) == len(header), "the checksum changed the header's size"
            f.seek(0)
            f.write(struct.pack("<Q", len(final)) + final)
            f.flush()
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, path)
        _fsync_folder(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    kept = int(valid.sum())
    return {"tokens": int(node_table["lengths"][valid.bool()].sum()), "nodes": kept, "dropped_nodes": nodes - kept,
            "bytes": size}


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_snapshot(path: Path, fingerprint: dict, num_layers: int, kv_shape: tuple[int, int],
                  kv_dtype: torch.dtype) -> SnapshotData:
    """The verified contents of the snapshot at `path`; SnapshotError for anything that does not
    match this model (fingerprint, geometry) or is not whole (sizes, node table, checksum)."""
    with open(_open_regular(Path(path)), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:  # checked before reading: /proc files say 0 and some refuse a read at offset 0
            raise SnapshotError(f"truncated: {size} bytes, not even a header")
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise SnapshotError(f"truncated or not a snapshot: header of {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
            metadata = header.pop("__metadata__")
        except (ValueError, KeyError, AttributeError) as e:
            raise SnapshotError(f"corrupt header: {e}") from e
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
            raise SnapshotError("not a RadixLM KV snapshot (no format tag in its metadata)")
        if metadata.get("version") != VERSION:
            raise SnapshotError(f"format version {metadata.get('version')!r}, this RadixLM reads {VERSION!r}")
        _check_fingerprint(metadata.get("fingerprint", ""), fingerprint)
        rows, nodes = _sizes(header)
        layout = _layout(num_layers, rows, nodes, kv_shape, kv_dtype)
        offset = 0
        for name, dtype, shape in layout:
            entry = header.get(name)
            size_b = _nbytes(dtype, shape)
            expected = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size_b]}
            if entry != expected:
                raise SnapshotError(f"tensor {name!r} is missing or does not fit this model's KV layout: {entry}")
            offset += size_b
        if len(header) != len(layout):
            raise SnapshotError(f"unexpected tensors: {sorted(set(header) - {name for name, _, _ in layout})}")
        if size != 8 + n + offset:
            raise SnapshotError(f"truncated or padded: {size} bytes, its header describes {8 + n + offset}")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        hasher = xxhash.xxh3_128()
        hasher.update(_signed_part(metadata))
        hasher.update(memoryview(mapped)[8 + n :])
        if hasher.hexdigest() != metadata.get("checksum"):
            raise SnapshotError("checksum mismatch: the file is corrupt")
        tensors = {}
        at = 8 + n
        for name, dtype, shape in layout:
            count = int(np.prod(shape, dtype=np.int64))
            tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=at).view(shape) if count \
                else torch.empty(shape, dtype=dtype)
            at += _nbytes(dtype, shape)
        data = SnapshotData(tensors["parents"].tolist(), tensors["lengths"].tolist(), tensors["hits"].tolist(),
                            [bool(x) for x in tensors["valid"].tolist()], tensors["tokens"],
                            [tensors[f"k.{i}"] for i in range(num_layers)],
                            [tensors[f"v.{i}"] for i in range(num_layers)], mapped)
    except BaseException:
        tensors = {}
        _close(mapped)
        raise
    try:
        _check_nodes(data, rows)
    except SnapshotError:
        data.close()
        raise
    return data


def _close(mapped: mmap.mmap) -> None:
    try:
        mapped.close()
    except BufferError:  # a tensor still views it: the mapping goes when that tensor does
        pass


def _sizes(header: dict) -> tuple[int, int]:
    try:
        return int(header["tokens"]["shape"][0]), int(header["parents"]["shape"][0])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise SnapshotError(f"corrupt header: no node table ({e})") from e


def _check_fingerprint(stored: str, expected: dict) -> None:
    try:
        theirs = json.loads(stored)
    except ValueError as e:
        raise SnapshotError(f"corrupt fingerprint: {e}") from e
    if not isinstance(theirs, dict):
        raise SnapshotError("corrupt fingerprint")
    differ = sorted(k for k in set(theirs) | set(expected) if theirs.get(k) != expected.get(k))
    if differ:
        shown = ", ".join(f"{k} (snapshot {theirs.get(k)!r}, this server {expected.get(k)!r})" for k in differ)
        raise SnapshotError(f"made by a different setup: {shown}")


def _check_nodes(data: SnapshotData, rows: int) -> None:
    for i, (p, n) in enumerate(zip(data.parents, data.lengths)):
        if not -1 <= p < i or n < 1:
            raise SnapshotError(f"corrupt node table at node {i} (parent {p}, length {n})")
    if sum(data.lengths) != rows:
        raise SnapshotError(f"corrupt node table: lengths sum to {sum(data.lengths)}, the file has {rows} rows")
