"""executor/cache_prune.py: a new conversion or int8 file removes the entries it replaces and those
whose source is gone, and nothing else (other sources, entries of unknown origin)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from radixlm.runtime.executor import loader as ml
from radixlm.runtime.executor.cache_prune import SOURCE_FILE, SOURCE_META
from radixlm.runtime.executor.cpu import int8_file as qfile


def _fake_convert(gguf, out_dir):
    (out_dir / "config.json").write_text(json.dumps({"model_type": "llama", "from": str(gguf)}))
    save_file({"w": torch.zeros(2)}, str(out_dir / "model.safetensors"))


def _gguf(path, content=b"GGUF fake"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _int8_file(cache, folder_name, key, meta=None):
    path = cache / "quantized" / f"{folder_name}-int8-{key}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.zeros(1)}, str(path), metadata={"format": "pt", **(meta or {})})
    return path


def test_a_new_conversion_removes_what_it_replaces_and_what_lost_its_source(tmp_path, monkeypatch):
    monkeypatch.setattr(ml, "_convert_gguf", _fake_convert)
    cache = tmp_path / "cache"
    model = _gguf(tmp_path / "venv1" / "m.gguf")
    other = _gguf(tmp_path / "venv2" / "m.gguf")  # the same file in another venv: another source
    first = ml._gguf_to_folder("m", model, cache)
    assert json.loads((first / SOURCE_FILE).read_text()) == {"source": str(model.resolve())}
    beside = ml._gguf_to_folder("m", other, cache)
    first_int8 = _int8_file(cache, first.name, "0123456789abcdef")
    legacy = cache / "old-0000000000000000"  # from before sources were recorded
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")

    os.utime(model, ns=(1, 1))  # the file changed: a new key
    second = ml._gguf_to_folder("m", model, cache)
    assert second != first and second.is_dir()
    assert not first.exists() and not first_int8.exists() and not (cache / f".{first.name}.lock").exists()
    assert beside.is_dir() and legacy.is_dir()  # another source, and one of unknown origin: kept

    other.unlink()  # its venv is gone: its conversion can never be hit again
    os.utime(model, ns=(2, 2))
    third = ml._gguf_to_folder("m", model, cache)
    assert sorted(p.name for p in cache.iterdir() if p.is_dir() and p.name != "quantized") == sorted(
        [third.name, legacy.name])


def test_a_cache_hit_records_the_source_of_an_older_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(ml, "_convert_gguf", _fake_convert)
    cache = tmp_path / "cache"
    model = _gguf(tmp_path / "m.gguf")
    folder = ml._gguf_to_folder("m", model, cache)
    (folder / SOURCE_FILE).unlink()
    assert ml._gguf_to_folder("m", model, cache) == folder
    assert json.loads((folder / SOURCE_FILE).read_text()) == {"source": str(model.resolve())}


def test_a_new_int8_file_removes_what_it_replaces_and_what_lost_its_source(tmp_path):
    cache = tmp_path / "cache"
    source = tmp_path / "model"
    source.mkdir()
    gone = tmp_path / "deleted-model"
    replaced = _int8_file(cache, "model", "aaaaaaaaaaaaaaaa", {SOURCE_META: str(source)})
    orphan = _int8_file(cache, "model", "bbbbbbbbbbbbbbbb", {SOURCE_META: str(gone)})
    other = tmp_path / "elsewhere" / "model"  # a folder of the same name elsewhere: another source
    other.mkdir(parents=True)
    kept = _int8_file(cache, "model", "cccccccccccccccc", {SOURCE_META: str(other)})
    unknown = _int8_file(cache, "model", "dddddddddddddddd")  # no recorded source
    path = cache / "quantized" / "model-int8-eeeeeeeeeeeeeeee.safetensors"
    assert qfile.write_cache(path, "eeeeeeeeeeeeeeee", {"x": torch.ones(1)}, source=source)
    assert path.is_file() and kept.is_file() and unknown.is_file()
    assert not replaced.exists() and not orphan.exists()
    assert qfile.read_cache(path, "eeeeeeeeeeeeeeee") is not None
