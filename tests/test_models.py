"""Our model implementations against transformers on the same weights (logits, all positions)."""

from __future__ import annotations

import pytest
import torch
from batch_utils import ManualBatches
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.forward_batch import CASCADE_MIN_SHARED, ForwardMode
from radixlm.runtime.executor.model_runner import ModelRunner

ATOL = 1e-4  # float32 on CPU; both sides use the same math up to summation order


def our_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One extend pass over all prompts in one batch; logits at every position."""
    mb = ManualBatches(runner)
    logits = mb.forward(ForwardMode.EXTEND, [(mb.new_seq(), p) for p in prompts])
    mb.release()
    return list(logits.split([len(p) for p in prompts]))


def decode_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill all but the last token, then one batched decode step; logits of that step."""
    mb = ManualBatches(runner)
    seqs = [mb.new_seq() for _ in prompts]
    for s, p in zip(seqs, prompts):
        mb.forward(ForwardMode.EXTEND, [(s, p[:-1])], logits="last")
    logits = mb.forward(ForwardMode.DECODE, [(s, [p[-1]]) for s, p in zip(seqs, prompts)])
    mb.release()
    return logits


def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


PROMPTS = [[1, 5, 9, 200, 3000, 17], [7] * 3, list(range(100, 140)), [42]]

ARCHS = [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("Qwen2ForCausalLM", {}),
    ("MistralForCausalLM", {"num_key_value_heads": 1}),
    ("Qwen3ForCausalLM", {"head_dim": 32}),  # heads wider than hidden / heads, as Qwen3's are
    ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                             "norm_topk_prob": True, "mlp_only_layers": [1]}),
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                             "norm_topk_prob": False}),
    ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    ("Phi3ForCausalLM", {"pad_token_id": 0}),
    ("Phi3ForCausalLM", {"pad_token_id": 0, "partial_rotary_factor": 0.75, "max_position_embeddings": 512,
                         "original_max_position_embeddings": 64,
                         "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(6)],
                                          "long_factor": [2.0 + i for i in range(6)]}}),
    ("Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 2,
                           "layer_types": ["sliding_attention", "full_attention"]}),
]


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(ARCHS)])
def test_tiny_models_match_transformers(make_tiny_model, arch, overrides):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(arch, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineArgs(model=str(folder), quantization="none",
                                    max_total_tokens=1024, max_running_requests=8))
    ours = our_logits(runner, PROMPTS)
    for p, got in zip(PROMPTS, ours):
        torch.testing.assert_close(got, hf_logits(ref, p), atol=ATOL, rtol=1e-4)
    # batched decode over requests of different lengths equals the reference at the last position
    dec = decode_logits(runner, [p for p in PROMPTS if len(p) > 1])
    for i, p in enumerate([p for p in PROMPTS if len(p) > 1]):
        torch.testing.assert_close(dec[i], hf_logits(ref, p)[-1], atol=ATOL, rtol=1e-4)
    assert runner.allocator.num_free == 1024


@pytest.mark.slow
def test_smollm2_logits_match_transformers(engine, hf_smollm, tokenizer):
    prompts = [tokenizer("The capital of France is").input_ids, tokenizer("def fib(n):\n    return").input_ids]
    ours = our_logits(engine.runner, prompts)
    for p, got in zip(prompts, ours):
        torch.testing.assert_close(got, hf_logits(hf_smollm, p), atol=2e-3, rtol=1e-3)


def test_decode_with_shared_prefix_slots_matches_transformers(make_tiny_model):
    """Requests that share cached prefix slots (cascade attention path) decode like transformers."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("LlamaForCausalLM", seed=3)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineArgs(model=str(folder), quantization="none",
                                    max_total_tokens=2048, max_running_requests=8))
    prefix = list(range(300, 300 + CASCADE_MIN_SHARED + 16))
    suffixes = [[11, 12, 13], [21], [31, 32, 33, 34, 35]]
    mb = ManualBatches(runner)
    root = mb.new_seq()
    mb.forward(ForwardMode.EXTEND, [(root, prefix)], logits="last")
    seqs = [mb.new_seq(root, len(prefix)) for _ in suffixes]
    for s, suf in zip(seqs, suffixes):
        if len(suf) > 1:  # all but the last suffix token go in by extend over the shared prefix
            mb.forward(ForwardMode.EXTEND, [(s, suf[:-1])], logits="last")
    logits = mb.forward(ForwardMode.DECODE, [(s, suf[-1:]) for s, suf in zip(seqs, suffixes)])
    assert mb.last_batch.attn_metadata.shared is not None
    assert mb.last_batch.attn_metadata.shared.numel() == len(prefix)
    for i, suf in enumerate(suffixes):
        torch.testing.assert_close(logits[i], hf_logits(ref, prefix + suf)[-1], atol=ATOL, rtol=1e-4)


def test_batched_extend_over_shared_prefix_matches_transformers(make_tiny_model):
    """Extend of several requests over the same cached prefix slots (extend cascade path)."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("LlamaForCausalLM", seed=4)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineArgs(model=str(folder), quantization="none",
                                    max_total_tokens=2048, max_running_requests=8))
    prefix = list(range(500, 500 + CASCADE_MIN_SHARED + 7))
    suffixes = [[11, 12, 13], [21], [31, 32, 33, 34, 35, 36]]
    mb = ManualBatches(runner)
    root = mb.new_seq()
    mb.forward(ForwardMode.EXTEND, [(root, prefix)], logits="last")
    logits = mb.forward(ForwardMode.EXTEND, [(mb.new_seq(root, len(prefix)), suf) for suf in suffixes])
    assert mb.last_batch.attn_metadata.shared is not None
    assert mb.last_batch.attn_metadata.shared.numel() == len(prefix)
    for got, suf in zip(logits.split([len(s) for s in suffixes]), suffixes):
        torch.testing.assert_close(got, hf_logits(ref, prefix + suf)[len(prefix):], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("gemm", ["onednn", "torch"])
def test_long_prompt_whole_and_chunked_matches_transformers(make_tiny_model, monkeypatch, gemm):
    """A prompt long enough for the blocked oneDNN attention kernel (several blocks), whole and in two
    chunks (the second over a cached prefix), next to a short one on SDPA; with torch's kernel the same
    batches take SDPA throughout."""
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.executor.attention import cpu_blocked
    from radixlm.runtime.executor.models.linear import onednn_usable

    if gemm == "onednn" and onednn_usable(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no usable oneDNN matmul")
    folder = make_tiny_model("LlamaForCausalLM", seed=6)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    monkeypatch.setattr(cpu_blocked, "beats_sdpa", lambda *shape: True)  # whichever is faster on this CPU
    runner = ModelRunner(EngineArgs(model=str(folder), quantization="none",
                                    max_total_tokens=2048, max_running_requests=8, cpu_gemm=gemm))
    gen = torch.Generator().manual_seed(6)
    long = torch.randint(3, 49000, (cpu_blocked.BLOCK * 2 + 77,), generator=gen).tolist()
    short = [5, 6, 7]
    want = hf_logits(ref, long)
    mb = ManualBatches(runner)
    whole = mb.forward(ForwardMode.EXTEND, [(mb.new_seq(), long), (mb.new_seq(), short)])
    assert mb.last_batch.attn_metadata.masks[0] == ("blocked" if gemm == "onednn" else None)
    torch.testing.assert_close(whole[: len(long)], want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(whole[len(long):], hf_logits(ref, short), atol=ATOL, rtol=1e-4)
    seq, cut = mb.new_seq(), 100
    first = mb.forward(ForwardMode.EXTEND, [(seq, long[:cut])])
    second = mb.forward(ForwardMode.EXTEND, [(seq, long[cut:])])
    assert mb.last_batch.attn_metadata.masks[0] == ("blocked" if gemm == "onednn" else cut)
    torch.testing.assert_close(torch.cat([first, second]), want, atol=ATOL, rtol=1e-4)
    mb.release()
    assert runner.allocator.num_free == 2048


@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(1, 9), dim=st.sampled_from([8, 96, 576]), dtype=st.sampled_from(["float32", "bfloat16"]),
       eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_the_fused_rms_norm_cuda_runs_computes_the_reference_norm(rows, dim, dtype, eps, seed):
    """CUDA runs RMSNorm as F.rms_norm's one kernel (`RMSNorm.fused`), the CPU as the reference's ops;
    on the CPU both give the same values: the same bits in float32, within one rounding in bfloat16
    (the fused form rounds once, the reference twice). A wrong eps, weight or axis fails it."""
    from radixlm.runtime.executor.models.llama import RMSNorm

    g = torch.Generator().manual_seed(seed)
    kind = getattr(torch, dtype)
    norm = RMSNorm(dim, eps).to(kind)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(dim, generator=g) * 2 - 0.5)
    x = (torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(kind)
    with torch.no_grad():
        ref, fused = norm(x), norm.fused(x)
    assert fused.dtype == ref.dtype == kind and fused.shape == ref.shape
    if kind == torch.float32:
        torch.testing.assert_close(fused, ref, rtol=2e-6, atol=1e-6)
    else:
        torch.testing.assert_close(fused.float(), ref.float(), rtol=2**-7, atol=1e-3)
