"""The architectures past Llama (Qwen3, Qwen3-MoE, Mixtral, Phi-3, Gemma 3) against transformers' own
classes: greedy ids through the Engine equal `generate`'s in float32 (cold in a batch, in small
prefill chunks, warm from the radix cache, one at a time), from an HF folder and from a GGUF file;
the MoE block against transformers' over random tokens, experts and top-k; LongRoPE's tables
against transformers' rotary embedding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime import Engine
from radixlm.runtime.executor.models.llama import RotaryEmbedding, rope_config
from radixlm.runtime.executor.models.moe import SparseMoE

NEAR_TIE = 1e-3  # float32 logits of two implementations differ by ~1e-5: a closer top-2 may swap
MAX_NEW = 12
SHARED = list(range(300, 348))  # a prefix several prompts share, so the warm run reads it from the cache
PROMPTS = [SHARED + [5, 9, 200], SHARED + [17, 4000, 8, 77, 1000], [7] * 3, list(range(1000, 1037)), [42],
           SHARED + list(range(2000, 2020))]
# a larger init than transformers' 0.02 spreads the logits, so few steps are near-ties
INIT = {"initializer_range": 0.2}
ARCHS = {
    "Qwen3ForCausalLM": {"head_dim": 32},
    "Qwen3MoeForCausalLM": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                            "norm_topk_prob": True, "mlp_only_layers": [1]},
    "MixtralForCausalLM": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Phi3ForCausalLM": {"pad_token_id": 0, "partial_rotary_factor": 0.75,
                        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(6)],
                                         "long_factor": [2.0 + i for i in range(6)]},
                        "original_max_position_embeddings": 256},
    # windows shorter than the prompts and the shared prefix: the warm run reads cached keys past them
    "Gemma3ForCausalLM": {"head_dim": 32, "sliding_window": 12, "query_pre_attn_scalar": 24,
                          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                          "num_hidden_layers": 3, "final_logit_softcapping": 30.0},
}


@dataclass(frozen=True)
class Greedy:
    ids: list[int]
    gaps: list[float]  # transformers' top-1 minus top-2 logit before each token


def reference(folder) -> list[Greedy]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 min_new_tokens=MAX_NEW, pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True)
            top2 = torch.cat(gen.scores).float().topk(2, dim=-1).values
            out.append(Greedy(gen.sequences[0, len(prompt):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()))
    return out


def assert_matches(outs: list[dict], want: list[Greedy], label: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, want, strict=True)):
        got = out["output_ids"]
        assert len(got) == MAX_NEW, f"{label}: prompt {i} has {len(got)} tokens"
        k = next((t for t, (a, b) in enumerate(zip(got, ref.ids)) if a != b), None)
        assert k is None or ref.gaps[k] < NEAR_TIE, (
            f"{label}: prompt {i} parts from transformers at token {k} ({got[k]} != {ref.ids[k]}) where "
            f"transformers' top-2 logit gap is {ref.gaps[k]:.2e}")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_transformers_cold_chunked_warm_and_alone(make_tiny_model, arch):
    folder = make_tiny_model(arch, **INIT, **ARCHS[arch])
    want = reference(folder)
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    with Engine(model=str(folder), quantization="none", max_total_tokens=4096, chunked_prefill_size=16,
                max_running_requests=8, log_level="warning") as engine:
        assert_matches(engine.generate(input_ids=PROMPTS, sampling_params=params), want, "cold batch, chunks of 16")
        assert_matches(engine.generate(input_ids=PROMPTS, sampling_params=params), want, "warm batch")
        for i, p in enumerate(PROMPTS):
            assert_matches([engine.generate(input_ids=p, sampling_params=params)], [want[i]], f"alone, prompt {i}")
        info = engine.get_server_info()
        assert info["kv_check"] == "ok", info["kv_check"]


@settings(max_examples=examples(60), deadline=None)
@given(tokens=st.integers(0, 40), experts=st.integers(1, 8), data=st.data(), normalize=st.booleans(),
       seed=st.integers(0, 2**16))
def test_sparse_moe_equals_transformers_block(tokens, experts, data, normalize, seed):
    """Every routing shape: no tokens, experts that get none, one expert taking all, top-k = all."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    top_k = data.draw(st.integers(1, experts))
    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=experts,
                                         num_experts_per_tok=top_k, norm_topk_prob=normalize)
    gen = torch.Generator().manual_seed(seed)
    ref = Qwen3MoeSparseMoeBlock(config).eval()
    ours = SparseMoE(32, 16, experts, top_k, normalize)
    with torch.no_grad():
        for p in (ref.gate.weight, ref.experts.gate_up_proj, ref.experts.down_proj):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        ours.gate.weight.copy_(ref.gate.weight)
        for e in range(experts):
            gate, up = ref.experts.gate_up_proj[e].chunk(2)
            ours.load_expert(e, "gate", gate)
            ours.load_expert(e, "up", up)
            ours.load_expert(e, "down", ref.experts.down_proj[e])
        x = torch.randn(tokens, 32, generator=gen)
        if tokens and data.draw(st.booleans()):  # every token alike: one set of experts takes them all
            x[:] = x[0]
        want = ref(x.unsqueeze(0))[0]
        got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [40, 300])
def test_longrope_tables_equal_transformers_where_the_factor_set_agrees(length):
    """Within the original context the short factors, past it the long ones: transformers picks one
    set for a whole sequence by its length, so positions agree where that set is the position's own."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                                     original_max_position_embeddings=64, partial_rotary_factor=0.5,
                                     rope_scaling={"rope_type": "longrope",
                                                   "short_factor": [1.0, 1.5, 2.0, 4.0],
                                                   "long_factor": [3.0, 5.0, 7.0, 9.0]})
    ref = Phi3RotaryEmbedding(config)
    positions = torch.arange(length)[None]
    cos, sin = ref(torch.zeros(1, length, 16), positions)
    theta, scaling = rope_config(config)
    ours = RotaryEmbedding(16, 512, theta, scaling)
    agree = slice(0, length) if length <= 64 else slice(64, length)
    torch.testing.assert_close(ours.cos[agree], cos[0, agree], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.sin_signed[agree, 4:], sin[0, agree, 4:], atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------------- from GGUF files
# llama.cpp's architecture names, and what their files cannot say (transformers' defaults are used;
# llama.cpp's qwen3moe has no dense layers)
GGUF_ARCHS = {"Qwen3ForCausalLM": ("qwen3", {"head_dim": 128}),
              "Qwen3MoeForCausalLM": ("qwen3moe", {"head_dim": 128, "moe_intermediate_size": 768,
                                                   "mlp_only_layers": []}),
              "Phi3ForCausalLM": ("phi3", {}),
              "Gemma3ForCausalLM": ("gemma3", {})}


GGUF_VOCAB = 4096  # past every id PROMPTS use


@pytest.fixture(scope="module")
def gguf_tokenizer() -> list[tuple[str, object, object]]:
    """A small byte-level BPE vocabulary for the files (key, value, type): the 256 bytes, then
    tokens no merge reaches (the tests feed ids); a real one takes transformers seconds to read."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    V = gguf.GGUFValueType
    tokens = [*bytes_to_unicode().values(), "ab", *(f"<t{i}>" for i in range(257, GGUF_VOCAB))]
    return [("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.tokens", tokens, V.ARRAY),
            ("tokenizer.ggml.token_type", [1] * GGUF_VOCAB, V.ARRAY), ("tokenizer.ggml.merges", ["a b"], V.ARRAY),
            ("tokenizer.ggml.bos_token_id", 1, V.UINT32), ("tokenizer.ggml.eos_token_id", 2, V.UINT32),
            ("tokenizer.ggml.padding_token_id", 0, V.UINT32)]


def write_gguf(folder, gguf_arch: str, path, tokenizer: list[tuple[str, object, object]], q4_0: bool = False) -> None:
    """A float32 GGUF of the HF checkpoint in `folder`, as llama.cpp's converter lays one out (tensor
    names, stacked experts, Gemma's norms stored as 1 + w), with the `gguf_tokenizer` entries; with
    `q4_0`, the layers' matmuls as Q4_0 blocks."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    for key, value, kind in tokenizer:
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, kind)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == gguf_arch)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        layer = name.split(".")[2] if ".layers." in name else None
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H] -> gate and up, each [E, I, H]
            gate, up = t.chunk(2, dim=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous().numpy())
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up.contiguous().numpy())
        elif name.endswith("mlp.experts.down_proj"):
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", t.numpy())
        else:
            if gguf_arch == "gemma3" and "norm" in name:
                t = t + 1
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if q4_0 and layer is not None and name.endswith("_proj.weight"):
                kind = gguf.GGMLQuantizationType.Q4_0
                w.add_tensor(gguf_name, gguf.quants.quantize(t.numpy(), kind), raw_dtype=kind)
            else:
                w.add_tensor(gguf_name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", list(GGUF_ARCHS))
def test_a_gguf_file_runs_as_transformers_reads_it(make_tiny_model, gguf_tokenizer, tmp_path, monkeypatch, arch):
    """A GGUF of each new architecture (float32, so nothing is rounded) loads through the GGUF path,
    and greedy ids equal transformers' `generate` on the model transformers reads from that file."""
    gguf_arch, overrides = GGUF_ARCHS[arch]
    folder = make_tiny_model(arch, **INIT, **{**ARCHS[arch], **overrides, "vocab_size": GGUF_VOCAB})
    write_gguf(folder, gguf_arch, tmp_path / "tiny.F32.gguf", gguf_tokenizer)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    # EOS held back as generate's min_new_tokens does (a small vocabulary makes it a likely pick)
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW}
    with Engine(model=str(tmp_path / "tiny.F32.gguf"), quantization="none", max_total_tokens=2048,
                log_level="warning") as engine:
        converted = engine.runner.model_path
        assert engine.runner.config.architectures == [arch]
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert_matches(outs, reference(converted), f"{arch} from GGUF")


def test_a_4bit_gguf_runs_on_its_blocks_without_reading_their_float_copies(make_tiny_model, gguf_tokenizer,
                                                                           tmp_path, monkeypatch, weights_read):
    """A Qwen2 GGUF (q/k/v biases) with Q4_0 matmuls: `auto` makes every layer matmul an int4 layer on the
    file's blocks before any weight is read, so the loader never reads their float32 copies; the fused
    biases are still the checkpoint's, and the layers multiply by the file's dequantized weights."""
    from radixlm.runtime.executor import loader
    from radixlm.runtime.executor.cpu.int4 import Int4Linear

    folder = make_tiny_model("Qwen2ForCausalLM", **INIT, vocab_size=GGUF_VOCAB)
    write_gguf(folder, "qwen2", tmp_path / "tiny.Q4_0.gguf", gguf_tokenizer, q4_0=True)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    with Engine(model=str(tmp_path / "tiny.Q4_0.gguf"), max_total_tokens=2048, log_level="warning") as engine:
        assert engine.runner.quantization == "int4"
        model, converted = engine.runner.model, engine.runner.model_path
        out = engine.generate(input_ids=PROMPTS[0], sampling_params={"temperature": 0, "max_new_tokens": 4})
    assert len(out["output_ids"]) == 4
    assert weights_read and not any(n.endswith("_proj.weight") for n in weights_read), sorted(weights_read)
    float_weights = loader.load_weights(converted, torch.float32, "cpu")  # the file's values, dequantized
    for i in range(2):
        qkv = model.layers[i].self_attn.qkv_proj
        assert isinstance(qkv, Int4Linear) and isinstance(model.layers[i].mlp.down_proj, Int4Linear)
        parts = [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"]
        assert torch.equal(qkv.bias, torch.cat([float_weights[f"{p}.bias"] for p in parts]))
        want = torch.cat([float_weights[f"{p}.weight"] for p in parts])
        torch.testing.assert_close(qkv.dequantized(), want, atol=2**-7 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch, gguf_arch, q4_0", [("LlamaForCausalLM", "llama", True),
                                                   ("Qwen2ForCausalLM", "qwen2", False),
                                                   ("Qwen3ForCausalLM", "qwen3", True)])
def test_a_streamed_conversion_writes_what_transformers_loader_makes_of_the_file(
        make_tiny_model, gguf_tokenizer, tmp_path, monkeypatch, arch, gguf_arch, q4_0):
    """llama, qwen2 and qwen3 files are dequantized a tensor at a time into the safetensors file: the
    folder's config, generation config and every tensor (llama's permuted q and k, qwen2's biases,
    qwen3's q/k norms, 4-bit blocks) equal, bit for bit, what transformers' model loader makes of it."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    from radixlm.runtime.executor import gguf_convert

    overrides = {**ARCHS.get(arch, {}), **GGUF_ARCHS.get(arch, ("", {}))[1], "vocab_size": GGUF_VOCAB}
    folder = make_tiny_model(arch, **INIT, **overrides)
    path = tmp_path / f"tiny.{'Q4_0' if q4_0 else 'F32'}.gguf"
    write_gguf(folder, gguf_arch, path, gguf_tokenizer, q4_0=q4_0)
    through_transformers = gguf_convert._write_through_transformers

    def refuse(*_):
        raise AssertionError("went through transformers' loader")

    monkeypatch.setattr(gguf_convert, "_write_through_transformers", refuse)
    streamed, reference = tmp_path / "streamed", tmp_path / "reference"
    streamed.mkdir(), reference.mkdir()
    gguf_convert.convert_gguf(path, streamed)
    through_transformers(path, reference, AutoConfig.from_pretrained(tmp_path, gguf_file=path.name))
    for name in ("config.json", "generation_config.json"):
        assert (streamed / name).read_text() == (reference / name).read_text(), name
    got, want = (load_file(f / gguf_convert.WEIGHTS_FILE) for f in (streamed, reference))
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert got[name].dtype == w.dtype and np.array_equal(got[name], w), name


def test_a_servers_first_start_converts_its_gguf_in_the_scheduler(make_tiny_model, gguf_tokenizer, tmp_path,
                                                                  monkeypatch):
    """The server's HTTP process never imports torch (server/torch_free.py), so a GGUF not converted
    yet is converted by the scheduler while the HTTP process waits for its folder, then serves: the
    same tokens as an Engine on that folder."""
    import httpx

    from radixlm.server import launch_server

    folder = make_tiny_model("LlamaForCausalLM", **INIT, vocab_size=GGUF_VOCAB)
    write_gguf(folder, "llama", tmp_path / "tiny.F32.gguf", gguf_tokenizer)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with launch_server(model=str(tmp_path / "tiny.F32.gguf"), port=0, quantization="none", max_total_tokens=2048,
                       log_level="warning") as h, httpx.Client(base_url=h.url, timeout=120) as c:
        converted = c.get("/server_info").json()["model_path"]
        got = c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": params}).json()
        maps = Path(f"/proc/{h.process.pid}/maps")
        assert not maps.exists() or "libtorch" not in maps.read_text()  # (Linux: what the process has loaded)
    assert converted.startswith(str(tmp_path / "cache"))
    with Engine(model=converted, quantization="none", max_total_tokens=2048, log_level="warning") as engine:
        assert got["output_ids"] == engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"]
