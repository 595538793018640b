"""Tests for radixlm.runtime.executor.loader: the GGUF cache's mechanics, with a fake converter so
that they run in milliseconds, dtype resolution and the default cache dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from radixlm.runtime.executor import loader as ml
from radixlm.runtime.executor.loader import (
    ModelLoadError,
    default_cache_dir,
    gguf_cache_key,
    load_weights,
    resolve_dtype,
    resolve_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# cache mechanics (with a fake converter, so they run in milliseconds)


def _fake_convert(src: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text('{"model_type": "llama"}')
    from safetensors.torch import save_file

    save_file({"w": torch.ones(2)}, str(out_dir / "model.safetensors"))


def test_cache_key_tracks_path_size_and_mtime(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"abc")
    key = gguf_cache_key(gguf)
    assert key.startswith("m-") and gguf_cache_key(str(gguf)) == key
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    touched = gguf_cache_key(gguf)
    assert touched != key
    gguf.write_bytes(b"abcd")
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_cache_key(gguf) not in (key, touched)
    other = tmp_path / "copy"
    other.mkdir()
    (other / "m.gguf").write_bytes(b"abcd")
    os.utime(other / "m.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_cache_key(other / "m.gguf") != gguf_cache_key(gguf)


def test_crash_mid_conversion_leaves_no_cache(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"

    def crashing_convert(src, out_dir):
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(ml, "_convert_gguf", crashing_convert)
    with pytest.raises(ModelLoadError, match="disk full") as info:
        resolve_model(str(gguf), cache_dir=cache)
    assert str(gguf) in str(info.value)
    assert [p for p in cache.iterdir() if p.is_dir()] == []

    calls = []
    monkeypatch.setattr(ml, "_convert_gguf", lambda src, out: (calls.append(src), _fake_convert(src, out)))
    source = resolve_model(str(gguf), cache_dir=cache)
    assert source.folder == cache / gguf_cache_key(gguf)
    assert load_weights(source.folder, torch.float32, CPU)["w"].tolist() == [1.0, 1.0]
    resolve_model(str(gguf), cache_dir=cache)
    assert len(calls) == 1


def test_stale_temp_folder_is_cleaned_and_changed_file_reconverts(monkeypatch, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    cache.mkdir()
    key = gguf_cache_key(gguf)
    stale = cache / f".{key}.tmp-999999-deadbeef"  # what a killed process leaves behind
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(ml, "_convert_gguf", lambda src, out: (calls.append(src), _fake_convert(src, out)))

    first = resolve_model(str(gguf), cache_dir=cache)
    assert not stale.exists() and len(calls) == 1

    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    second = resolve_model(str(gguf), cache_dir=cache)
    assert len(calls) == 2 and second.folder != first.folder

    # An incomplete cache folder (weights deleted by hand) is rebuilt, not trusted.
    (second.folder / "model.safetensors").unlink()
    third = resolve_model(str(gguf), cache_dir=cache)
    assert len(calls) == 3 and third.folder == second.folder
    assert (third.folder / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------
# dtype and cache dir


def test_resolve_dtype():
    assert resolve_dtype("auto", CPU) is torch.float32
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("float32", CPU) is torch.float32
    assert resolve_dtype("float", CPU) is torch.float32
    assert resolve_dtype("float16", CPU) is torch.float16
    assert resolve_dtype("half", CPU) is torch.float16
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    assert resolve_dtype("BFloat16", CPU) is torch.bfloat16
    assert resolve_dtype(torch.float16, CPU) is torch.float16
    with pytest.raises(ValueError) as info:
        resolve_dtype("int4", CPU)
    message = str(info.value)
    assert "'int4'" in message
    for choice in ("auto", "float32", "float16", "bfloat16", "half", "float"):
        assert choice in message


def test_resolve_dtype_auto_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda:0")) is torch.float16


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "here"))
    assert default_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("RADIXLM_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "radixlm"
