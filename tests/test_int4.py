"""4-bit weights (--quantization int4): the built-in Q4_1 GGUF's own blocks, read straight from the
file, equal transformers' dequantization of it exactly; the kernel multiplies by them within its
bfloat16 rounding; the model's greedy choices follow float32's; a rounded model's groups are Q4_1's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=40, deadline=None)
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


def test_int4_greedy_choices_follow_float32(engine, tokenizer):
    """Teacher-forced over a text, the int4 model's top choice is float32's at nearly every position
    (4-bit weights and bfloat16 rows move near-ties only)."""
    from radixlm.runtime import Engine

    text = ("The lighthouse keeper climbed the ninety steps every evening, trimmed the wick and wrote the "
            "weather into a blue logbook. One winter a storm broke the window of the lamp room.")
    ids = tokenizer(text).input_ids
    args = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1}
    params = {"max_new_tokens": 1, "temperature": 0}
    ref = engine.generate(input_ids=ids, sampling_params=params, **args)["meta_info"]["input_top_logprobs"]
    with Engine(model=str(engine.runner.model_path), quantization="int4", max_total_tokens=2048,
                log_level="warning") as e4:
        assert e4.runner.matmuls.startswith("int4")
        got = e4.generate(input_ids=ids, sampling_params=params, **args)["meta_info"]["input_top_logprobs"]
    pairs = [(a[0][1], b[0][1]) for a, b in zip(ref, got) if a and b]
    agree = sum(x == y for x, y in pairs) / len(pairs)
    assert len(pairs) == len(ids) - 1 and agree >= 0.9, agree


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
