"""4-bit weights (--quantization int4): the built-in Q4_1 GGUF's own blocks, read straight from the
file, equal transformers' dequantization of it exactly; the kernel multiplies by them within its
bfloat16 rounding; the model's greedy choices follow float32's; a rounded model's groups are Q4_1's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.executor.cpu.int4 import GROUP, Int4Linear, gguf_source, quantize, read_gguf_matmuls
from radixlm.runtime.executor.loader import load_config, load_weights

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no int4 CPU kernel")
PARTS = {"self_attn.qkv_proj": ("self_attn", "qkv"), "self_attn.o_proj": ("self_attn", "o"),
         "mlp.gate_up_proj": ("mlp", ("gate", "up")), "mlp.down_proj": ("mlp", ("down",))}


def test_the_files_blocks_are_transformers_weights_exactly(smollm_folder):
    source = gguf_source(smollm_folder)
    assert source is not None and source.name.endswith("Q4_1.gguf")
    config = load_config(smollm_folder)
    blocks = read_gguf_matmuls(source, config)
    assert len(blocks) == 4 * config.num_hidden_layers  # every matmul of every layer is Q4_1
    weights = load_weights(smollm_folder, torch.float32, "cpu")
    for layer in (0, 17, config.num_hidden_layers - 1):
        for fused, (kind, parts) in PARTS.items():
            q, scale, zero = blocks[f"layers.{layer}.{fused}"]
            got = (q.float() - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)
            want = torch.cat([weights[f"model.layers.{layer}.{kind}.{p}_proj.weight"] for p in parts])
            assert torch.equal(got, want), (layer, fused)  # q and k un-permuted as transformers does


@settings(max_examples=examples(40), deadline=None)
@given(n=st.sampled_from([32, 96]), groups=st.integers(1, 6), rows=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_the_kernel_multiplies_by_its_dequantized_weight(n, groups, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, groups * GROUP, generator=gen)
    q, scale, zero = quantize(weight)
    deq = (q.float() - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)
    assert (deq - weight).abs().le(scale.repeat_interleave(GROUP, 1) / 2 + 1e-6).all()  # nearest of 16 levels
    layer = Int4Linear(q, scale, zero, None)
    x = torch.randn(rows, groups * GROUP, generator=gen)
    want = x.to(torch.bfloat16).float() @ layer.dequantized().t()
    torch.testing.assert_close(layer(x), want, atol=0.05 * want.abs().max().item() + 1e-3, rtol=0.02)


@settings(max_examples=examples(15), deadline=None)
@given(blocks=st.integers(1, 3), groups=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_long_products_run_on_the_weight_the_kernel_multiplies_by(blocks, groups, seed):
    """From prefill_rows() rows (on a CPU with bfloat16 dot products) a product runs on the layer's
    weight unpacked to bfloat16: the unpacking reads torch's packing exactly, and the product equals
    the 4-bit kernel's within bfloat16 rounding."""
    from radixlm.runtime.executor.cpu.int4 import bf16_matmuls, prefill_rows, unpack

    n, k = 64 * blocks, GROUP * groups
    gen = torch.Generator().manual_seed(seed)
    q, scale, zero = quantize(torch.randn(n, k, generator=gen))
    layer = Int4Linear(q, scale, zero, None)
    assert torch.equal(unpack(layer.packed, n, k).int(), q.int())
    assert torch.equal(layer.unpacked().float(), layer.dequantized())
    x = torch.randn(prefill_rows(), k, generator=gen)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), layer.packed, GROUP,
                                                        layer.scales_zeros).float()
    got = layer(x)
    unpacked = torch.mm(x.to(torch.bfloat16), layer.unpacked().t()).float()
    assert torch.equal(got, unpacked if bf16_matmuls() else kernel)
    torch.testing.assert_close(unpacked, kernel, atol=0.02 * kernel.abs().max().item(), rtol=0.02)


def test_int4_greedy_choices_follow_float32(engine, tokenizer, weights_read):
    """The default (auto) runs the built-in Q4_1 GGUF as int4, every matmul on the file's own blocks,
    whose float copies are never read; teacher-forced over a text, its top choice is float32's at nearly
    every position (4-bit weights and bfloat16 rows move near-ties only). Deterministic inference keeps
    float32."""
    from radixlm.runtime import Engine

    text = ("The lighthouse keeper climbed the ninety steps every evening, trimmed the wick and wrote the "
            "weather into a blue logbook. One winter a storm broke the window of the lamp room.")
    ids = tokenizer(text).input_ids
    args = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1}
    params = {"max_new_tokens": 1, "temperature": 0}
    ref = engine.generate(input_ids=ids, sampling_params=params, **args)["meta_info"]["input_top_logprobs"]
    with Engine(model=str(engine.runner.model_path), max_total_tokens=2048, log_level="warning") as e4:
        assert e4.runner.quantization == "int4" and e4.runner.matmuls.startswith("int4")
        rounded = [n for n, m in e4.runner.model.named_modules() if ".layers." in f".{n}" and
                   type(m).__name__ in ("Linear", "Fp16Linear")]
        assert rounded == [], rounded
        assert weights_read and not any(n.endswith("_proj.weight") for n in weights_read), sorted(weights_read)
        # the token embeddings are the file's Q8_0 rows, mapped: float32's values exactly (the folder's
        # are the file's dequantized), not an fp16 copy
        embed = e4.runner.model.embed_tokens
        assert type(embed).__name__ == "GgufQ8Embedding", type(embed)
        rows = torch.tensor(ids + [0, 1, embed.num_embeddings - 1])
        assert torch.equal(embed(rows), engine.runner.model.embed_tokens.weight[rows])
        got = e4.generate(input_ids=ids, sampling_params=params, **args)["meta_info"]["input_top_logprobs"]
    pairs = [(a[0][1], b[0][1]) for a, b in zip(ref, got) if a and b]
    agree = sum(x == y for x, y in pairs) / len(pairs)
    assert len(pairs) == len(ids) - 1 and agree >= 0.9, agree


def test_auto_picks_int4_only_for_a_4bit_file_on_the_cpu_without_determinism():
    from radixlm.runtime.executor.cpu.fp16 import fp16_unavailable
    from radixlm.runtime.executor.cpu.quantization import resolve_quantization

    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_quantization("auto", cpu, f32, file_4bit=True) == "int4"
    assert resolve_quantization("auto", cpu, f32, float_matmuls=True, file_4bit=True) == "none"
    assert resolve_quantization("auto", cpu, torch.bfloat16, file_4bit=True) == "none"
    assert resolve_quantization("auto", torch.device("meta"), f32, file_4bit=True) == "none"
    assert resolve_quantization("auto", cpu, f32) == ("fp16" if fp16_unavailable() is None else "none")
    assert resolve_quantization("int4", cpu, f32) == "int4"  # asked for: any float32 model, rounded


def test_the_tensor_index_is_gguf_pys(smollm_folder):
    """gguf_tensors reads the index without building the metadata; gguf-py's reader builds it all."""
    import numpy as np
    from gguf import GGUFReader

    from radixlm.runtime.executor.gguf_tensors import read_gguf

    source = gguf_source(smollm_folder)
    arch, tensors = read_gguf(source)
    reader = GGUFReader(str(source))
    assert arch == "llama" and set(tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        ours = tensors[t.name]
        assert (ours.kind, ours.shape) == (t.tensor_type.name, tuple(int(d) for d in t.shape))
        assert np.array_equal(ours.data.reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))


def random_blocks(kind: str, rows: int, blocks: int, seed: int):
    """Random raw rows of a GGUF block type, every fp16 scale finite and small."""
    import numpy as np

    from radixlm.runtime.executor.gguf_tensors import BLOCKS

    rng = np.random.default_rng(seed)
    nbytes = BLOCKS[kind][1]
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    halves = {"Q4_0": 1, "Q4_1": 2, "Q4_K": 2, "Q8_0": 1}[kind]  # leading fp16 scales (and minimums) of a block
    raw[..., : 2 * halves] = rng.uniform(1e-3, 0.1, (rows, blocks, halves)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


@settings(max_examples=examples(30), deadline=None)
@given(kind=st.sampled_from(["Q4_0", "Q4_1", "Q4_K"]), rows=st.integers(1, 4), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_gguf_blocks_are_gguf_pys_dequantization(kind, rows, blocks, seed):
    """A block type's (q, scale, zero) groups give gguf-py's (ggml's) dequantized values, but for
    float32's rounding of (q - 8) * scale + zero against ggml's d * q - m."""
    from gguf import GGMLQuantizationType, quants

    from radixlm.runtime.executor.cpu.int4 import gguf_blocks

    raw = random_blocks(kind, rows, blocks, seed)
    q, scale, zero = gguf_blocks(kind, raw)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    got = (q.float() - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_q4_k_files_matmuls_are_read_and_others_left_out(tmp_path, monkeypatch, arch):
    """A Q4_K_M-like GGUF: its Q4_K matmuls are read under the fused names, a llama file's q and k
    un-permuted as llama.cpp's converter permuted them; a fused matrix with a Q6_K part is left to
    rounding."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from transformers import LlamaConfig

    from radixlm.runtime.executor.gguf_tensors import unpermute_rows

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    shapes = {"attn_q": 256, "attn_k": 128, "attn_v": 128, "attn_output": 256, "ffn_gate": 512, "ffn_up": 512,
              "ffn_down": 256}
    writer = GGUFWriter(str(tmp_path / "m.gguf"), arch)
    raws = {}
    for layer in range(2):
        for k, (part, rows) in enumerate(shapes.items()):
            inputs = 512 if part == "ffn_down" else 256
            kind = "Q6_K" if (layer, part) == (1, "attn_v") else "Q4_K"
            if kind == "Q6_K":  # any bytes: it is only indexed
                raw = np.random.default_rng(k).integers(0, 256, (rows, inputs // 256 * 210), dtype=np.uint8)
            else:
                raw = random_blocks("Q4_K", rows, inputs // 256, seed=100 * layer + k)
            raws[(layer, part)] = raw
            writer.add_tensor(f"blk.{layer}.{part}.weight", raw, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    blocks = read_gguf_matmuls(tmp_path / "m.gguf", config)
    assert set(blocks) == {f"layers.{i}.{f}" for i in range(2) for f in PARTS} - {"layers.1.self_attn.qkv_proj"}

    def dequantized(layer, part):
        w = torch.from_numpy(quants.dequantize(raws[(layer, part)], GGMLQuantizationType.Q4_K))
        permuted = arch == "llama" and part in ("attn_q", "attn_k")
        return unpermute_rows(w, 4 if part == "attn_q" else 2) if permuted else w

    fused = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
             "mlp.down_proj": ("ffn_down",)}
    for name, parts in fused.items():
        q, scale, zero = blocks[f"layers.0.{name}"]
        got = (q.float() - 8) * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)
        want = torch.cat([dequantized(0, p) for p in parts])
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=name)

    # the model's matmuls: under auto the file's 4-bit ones are read and the one with a Q6_K part stays
    # as it is (fp16 next: never below the file's precision); asked for int4, that one is rounded
    from torch import nn

    from radixlm.runtime.executor.cpu import int4
    from radixlm.runtime.executor.models.linear import Linear

    def model():
        root = nn.Module()
        root.config = config
        root.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.self_attn, layer.mlp = nn.Module(), nn.Module()
            layer.self_attn.qkv_proj, layer.self_attn.o_proj = Linear(256, 512), Linear(256, 256)
            layer.mlp.gate_up_proj, layer.mlp.down_proj = Linear(256, 1024), Linear(512, 256)
            root.layers.append(layer)
        return root

    monkeypatch.setattr(int4, "gguf_source", lambda folder: tmp_path / "m.gguf")
    assert int4.has_4bit_matmuls(tmp_path)
    auto = model()
    replaced = int4.int4_from_file(auto, tmp_path)  # the checkpoint names the loader then skips
    parts = {"self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert replaced == {f"model.layers.{i}.{p}.weight" for i in range(2) for p in parts} | {
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    assert type(auto.layers[1].self_attn.qkv_proj) is Linear and isinstance(auto.layers[0].self_attn.qkv_proj,
                                                                             Int4Linear)
    assert int4.round_to_int4(auto) == 1 and isinstance(auto.layers[1].self_attn.qkv_proj, Int4Linear)


@settings(max_examples=examples(30), deadline=None)
@given(vocab=st.integers(1, 6), blocks=st.integers(1, 4), ids=st.lists(st.integers(0, 5), min_size=1, max_size=8),
       seed=st.integers(0, 2**16))
def test_q8_embedding_rows_are_gguf_pys_dequantization(vocab, blocks, ids, seed):
    """A lookup of Q8_0 rows gives gguf-py's dequantized rows exactly (d * q is exact in float32), in
    the ids' shape."""
    from gguf import GGMLQuantizationType, quants

    from radixlm.runtime.executor.cpu.gguf_embedding import GgufQ8Embedding

    raw = random_blocks("Q8_0", vocab, blocks, seed)
    embed = GgufQ8Embedding(torch.from_numpy(raw), blocks * 32, "test")
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    index = torch.tensor([i % vocab for i in ids])
    assert torch.equal(embed(index), want[index])
    assert torch.equal(embed(index.view(1, -1)), want[index].view(1, -1, blocks * 32))

