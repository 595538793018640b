"""Weight caches that can never be read again are removed when a new one is written.

A GGUF's float32 conversion (`loader._gguf_to_folder`) and an int8 file (`cpu/int8_file.write_cache`)
are keyed by their source's path, size and mtime and by a format version. So a package installed
into a new virtualenv (a new path), an updated file or a new format leaves the old entries behind
for good: ~675 MB per entry for SmolLM2-135M, adding up over virtualenvs and upgrades. So each entry
records its source: a conversion folder in `SOURCE_FILE`, an int8 file in its metadata. After a new
entry is written, the entries it replaces (the same source under an older key) and those whose
source no longer exists are removed. Entries that record no source are left alone.
Removing is safe while another process still reads an entry: Linux keeps an open or mapped file
until its last user closes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE_FILE = "radixlm-source.json"
SOURCE_META = "radixlm_source"  # the int8 file's metadata key


def record_source(folder: Path, source: Path) -> None:
    (folder / SOURCE_FILE).write_text(json.dumps({"source": str(source)}))


def recorded_source(folder: Path) -> str | None:
    try:
        source = json.loads((folder / SOURCE_FILE).read_text())["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if isinstance(source, str) else None


def _gone_or_replaced(source: str | None, current: Path) -> bool:
    return source is not None and (source == str(current) or not Path(source).exists())


def prune_conversions(cache: Path, kept: Path, source: Path,
                      lock: Callable[[Path], contextlib.AbstractContextManager]) -> list[Path]:
    """Removes the conversion folders in `cache` (other than `kept`, just written from `source`) that
    `source` replaces or whose source is gone, each under its conversion lock, with its lock file and
    its int8 files. Returns what was removed."""
    removed = []
    for folder in sorted(cache.iterdir()):
        if folder == kept or folder.name.startswith(".") or not folder.is_dir():
            continue
        if not _gone_or_replaced(recorded_source(folder), source):
            continue
        lock_file = cache / f".{folder.name}.lock"
        with lock(lock_file):  # never while another process converts into it
            shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            lock_file.unlink()
        for quantized in (cache / "quantized").glob(f"{folder.name}-*.safetensors"):
            with contextlib.suppress(OSError):
                quantized.unlink()
        removed.append(folder)
    return _logged(removed, "cached conversion(s)")


def prune_quantized(kept: Path, source: Path, prefix: str) -> list[Path]:
    """Removes the int8 files beside `kept` (just written from the folder `source`) named `prefix`*
    that it replaces or whose source folder is gone. Returns what was removed."""
    from safetensors import safe_open

    removed = []
    for path in sorted(kept.parent.glob(f"{prefix}*.safetensors")):
        if path == kept:
            continue
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                recorded = (f.metadata() or {}).get(SOURCE_META)
        except Exception:  # a damaged file of unknown origin: not ours to judge
            continue
        if _gone_or_replaced(recorded, source):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return _logged(removed, "int8 cache file(s)")


def _logged(removed: list[Path], what: str) -> list[Path]:
    if removed:
        logger.info("removed %d %s that can no longer be used: %s", len(removed), what,
                    ", ".join(p.name for p in removed))
    return removed
