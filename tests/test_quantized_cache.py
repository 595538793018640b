"""The int8 weights' cache file (executor/cpu/quantization.py, executor/cpu/int8_file.py): written once and
read on every restart (nothing quantized again), keyed by the code that makes the numbers, its embedding
rows mapped and paged in only where looked up, rebuilt when damaged or stale."""

from __future__ import annotations

import logging

import pytest
import torch
from test_quantization import KERNEL, SECOND, needs_int8

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.cpu import int8 as ql
from radixlm.runtime.executor.cpu import int8_file as qfile
from radixlm.runtime.executor.cpu import quantization as quant
from radixlm.runtime.executor.model_runner import ModelRunner


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path))
    return tmp_path


def _runner(folder, batch_packing: str = "off") -> ModelRunner:
    return ModelRunner(EngineArgs(model=str(folder), quantization="int8", max_total_tokens=256,
                                  max_running_requests=4, log_level="warning", int8_batch_packing=batch_packing))


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    from radixlm.runtime.executor.cpu.calibration import prefill_once

    return prefill_once(runner.model, runner.attn_backend, ids)


def _cache_file(cache_dir):
    files = sorted((cache_dir / "quantized").glob("*.safetensors"))
    assert len(files) == 1, files
    return files[0]


def test_the_cache_key_is_a_format_version_not_the_codes_text(tmp_path, monkeypatch):
    """Editing a comment must not discard every user's int8 cache: the key names the format version
    (bumped when the numbers change) and the attention backend the calibration ran on, not source text."""
    model = torch.nn.Linear(2, 2)
    key = quant.cache_path(tmp_path, "int8", model, tmp_path)
    assert quant.cache_path(tmp_path, "int8", model, tmp_path) == key
    assert quant.cache_path(tmp_path, "int8", model, tmp_path, "invariant")[1] != key[1]
    monkeypatch.setattr(quant, "_FORMAT_VERSION", quant._FORMAT_VERSION + 1)
    assert quant.cache_path(tmp_path, "int8", model, tmp_path)[1] != key[1]


@needs_int8
@pytest.mark.parametrize("tied", [False, True])
def test_restart_reads_the_cache_and_never_quantizes_again(make_tiny_model, cache_dir, monkeypatch, tied):
    folder = make_tiny_model(tie_word_embeddings=tied, seed=3)
    first = _runner(folder)
    path = _cache_file(cache_dir)
    assert any(isinstance(m, ql.Int8Linear) for m in first.model.modules())
    assert isinstance(first.model.embed_tokens, ql.Int8Embedding)
    assert isinstance(first.model.lm_head, ql.Int8Linear)
    assert first.matmuls == f"int8 ({KERNEL.name})"

    def no_quantizing(*args, **kwargs):
        raise AssertionError("quantized again although the cache file is valid")

    monkeypatch.setattr(quant, "quantize_state", no_quantizing)
    monkeypatch.setattr(quant, "input_channel_max", no_quantizing)
    monkeypatch.setattr(ql, "_has_amx", lambda: True)  # the second runner packs twice where two kernels work
    second = _runner(folder, "auto")
    assert _cache_file(cache_dir) == path
    if SECOND is not None:
        assert second.matmuls == f"int8 ({KERNEL.name}, {SECOND.name} from {ql.MANY_ROWS} rows)"
    ids = list(range(5, 40))  # 35 rows: the second runner's products run on its second packing
    assert torch.equal(_logits(first, ids), _logits(second, ids))
    float_runner = ModelRunner(EngineArgs(model=str(folder), max_total_tokens=256, max_running_requests=4))
    assert quant.resident_weight_bytes(first.model) < 0.5 * quant.resident_weight_bytes(float_runner.model)
    # the embedding rows are read from the file, both after writing it and after reading it
    for runner in (first, second):
        assert runner.model.embed_tokens.mapped
        assert qfile.mapped_weight_bytes(runner.model) == runner.model.embed_tokens.qweight.numel()


@needs_int8
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_embedding_rows_are_mapped_from_the_cache_and_paged_in_only_where_looked_up(make_tiny_model, cache_dir,
                                                                                     monkeypatch):
    """The 24 MiB table is not resident; a lookup pages in the rows around it (the kernel maps a
    just-written file's pages in large folios, up to 2 MiB around each row: hence ids close together)."""
    folder = make_tiny_model(tie_word_embeddings=True, seed=6, hidden_size=512, intermediate_size=256)
    ids = [3, 17, 20, 33, 5]
    mapped = _runner(folder)
    table = mapped.model.embed_tokens.qweight
    assert mapped.model.embed_tokens.mapped_from == str(_cache_file(cache_dir).resolve())
    assert qfile.mapped_resident_bytes(mapped.model) < table.numel() // 100
    got = _logits(mapped, ids)
    assert 0 < qfile.mapped_resident_bytes(mapped.model) < table.numel() // 4
    monkeypatch.setattr(quant, "map_embeddings", lambda model, path: 0)
    held = _runner(folder)
    assert not held.model.embed_tokens.mapped and qfile.mapped_weight_bytes(held.model) == 0
    assert torch.equal(held.model.embed_tokens.qweight, table)
    assert torch.equal(_logits(held, ids), got)
    assert quant.resident_weight_bytes(held.model) - quant.resident_weight_bytes(mapped.model) == table.numel()


@needs_int8
def test_a_cache_that_cannot_be_written_keeps_the_rows_in_memory(make_tiny_model, cache_dir, caplog):
    folder = make_tiny_model(seed=7)
    (cache_dir / "quantized").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.executor.cpu.quantization"):
        runner = _runner(folder)
    assert "cannot write the quantized cache" in caplog.text
    assert not runner.model.embed_tokens.mapped and qfile.mapped_weight_bytes(runner.model) == 0
    (cache_dir / "quantized").unlink()
    ids = list(range(9, 33))
    assert torch.equal(_logits(runner, ids), _logits(_runner(folder), ids))


def test_map_tensor_refuses_what_the_file_does_not_hold(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    rows = torch.arange(-60, 60, dtype=torch.int8).reshape(10, 12)
    save_file({"a.qweight": rows, "b": torch.zeros(3)}, str(path))
    assert torch.equal(qfile.map_tensor(path, "a.qweight", (10, 12)), rows)
    for name, shape in (("a.qweight", (12, 10)), ("b", (3,)), ("c", (1,))):
        with pytest.raises(ValueError):
            qfile.map_tensor(path, name, shape)
    path.write_bytes(path.read_bytes()[:-50])  # rows cut off
    with pytest.raises(ValueError, match="outside"):
        qfile.map_tensor(path, "a.qweight", (10, 12))


@needs_int8
def test_input_scales_fold_upstream_without_changing_the_answer(make_tiny_model, cache_dir, monkeypatch):
    """Smoothing's input scales of qkv, gate_up and down are applied in the norms and in up's weight
    scales (one op fewer each per layer); o_proj keeps its own. Each layer computes what the unfolded
    one does, up to float rounding (a rounding flip moves one activation by one int8 step)."""
    from safetensors.torch import load_file, save_file

    from radixlm.runtime.executor.models.llama import LlamaForCausalLM

    folder = make_tiny_model(seed=5)
    weights = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, w in weights.items():  # norms initialised to ones would make the norm folds trivial
        if name.endswith("norm.weight"):
            weights[name] = w * (0.5 + torch.rand(w.shape, generator=gen))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    folded = _runner(folder)
    kept = {name.rsplit(".", 1)[-1] for name, m in folded.model.named_modules()
            if isinstance(m, ql.Int8Linear) and m.input_scale is not None}
    assert kept == {"o_proj"}
    monkeypatch.setattr(LlamaForCausalLM, "input_scale_folds", lambda self: {})
    unfolded = _runner(folder)
    assert all(m.input_scale is not None for name, m in unfolded.model.named_modules()
               if isinstance(m, ql.Int8Linear) and name != "lm_head")
    h = torch.randn(9, 64, generator=gen)
    for f, u in zip(folded.model.layers, unfolded.model.layers):
        pairs = [(f.self_attn.qkv_proj(f.input_layernorm(h)), u.self_attn.qkv_proj(u.input_layernorm(h))),
                 (f.mlp(f.post_attention_layernorm(h)), u.mlp(u.post_attention_layernorm(h)))]
        for a, b in pairs:
            assert not torch.equal(a, b)  # folded: rounded differently
            assert (a - b).abs().max() <= 0.02 * b.abs().mean()
    ids = list(range(5, 60))
    assert torch.equal(_logits(folded, ids).argmax(-1), _logits(unfolded, ids).argmax(-1))


@needs_int8
@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "wrong shapes"])
def test_a_damaged_or_stale_cache_file_is_rebuilt(make_tiny_model, cache_dir, caplog, damage):
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(seed=4)
    ids = list(range(7, 30))
    want = _logits(_runner(folder), ids)
    path = _cache_file(cache_dir)
    good = path.read_bytes()
    good_tensors = {k: v.clone() for k, v in load_file(str(path)).items()}  # load_file maps the file
    if damage == "garbage":
        path.write_bytes(b"\x00not a safetensors file" * 10)
    elif damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "other key":
        save_file({"x": torch.zeros(1)}, str(path), metadata={"radixlm_quantized": "0123456789abcdef"})
    else:
        key = path.stem.rsplit("-", 1)[-1]
        save_file({"layers.0.mlp.down_proj.qweight": torch.zeros(2, 2, dtype=torch.int8)}, str(path),
                  metadata={"radixlm_quantized": key})
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.executor.cpu.quantization"):
        runner = _runner(folder)
    assert "rebuilding" in caplog.text
    rebuilt = load_file(str(path))  # quantizing is deterministic: the rebuilt file holds the same tensors
    assert rebuilt.keys() == good_tensors.keys() and all(torch.equal(rebuilt[k], good_tensors[k]) for k in rebuilt)
    assert torch.equal(_logits(runner, ids), want)
