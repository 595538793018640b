"""Our model implementations against transformers on the same weights (logits, all positions)."""

from __future__ import annotations

import pytest
import torch

from radixlm.runtime.forward_batch import ForwardMode
from radixlm.runtime.model_runner import ModelRunner
from radixlm.runtime.server_args import ServerArgs

ATOL = 1e-4  # float32 on CPU; both sides use the same math up to summation order


def our_logits(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One extend pass over all prompts in one batch; logits at every position."""
    ids, pos, kv, lens, rows = [], [], [], [], []
    slots = runner.allocator.alloc(sum(map(len, prompts)))
    off = 0
    for p in prompts:
        ids += p
        pos += range(len(p))
        kv.append(slots[off : off + len(p)])
        lens.append(len(p))
        off += len(p)
    rows = list(range(len(ids)))
    fb = runner.make_batch(ForwardMode.EXTEND, ids, pos, slots, kv, lens, rows)
    logits = runner.forward(fb)
    runner.allocator.free(slots)
    out, off = [], 0
    for p in prompts:
        out.append(logits[off : off + len(p)])
        off += len(p)
    return out


def decode_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill all but the last token, then one batched decode step; logits of that step."""
    slots, kv, ids, pos = [], [], [], []
    runner_slots = [runner.allocator.alloc(len(p)) for p in prompts]
    for p, s in zip(prompts, runner_slots):
        fb = runner.make_batch(ForwardMode.EXTEND, p[:-1], list(range(len(p) - 1)), s[:-1], [s[:-1]],
                               [len(p) - 1], [len(p) - 2])
        runner.forward(fb)
        ids.append(p[-1])
        pos.append(len(p) - 1)
        kv.append(s)
        slots.append(s[-1:])
    fb = runner.make_batch(ForwardMode.DECODE, ids, pos, torch.cat(slots), kv, [1] * len(prompts),
                           list(range(len(prompts))))
    logits = runner.forward(fb)
    for s in runner_slots:
        runner.allocator.free(s)
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
]


@pytest.mark.parametrize("arch,overrides", ARCHS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(ARCHS)])
def test_tiny_models_match_transformers(make_tiny_model, arch, overrides):
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(arch, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(model=str(folder), max_total_tokens=1024, max_running_requests=8))
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

    from radixlm.runtime.attention import torch_backend

    folder = make_tiny_model("LlamaForCausalLM", seed=3)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(model=str(folder), max_total_tokens=2048, max_running_requests=8))
    prefix = list(range(300, 300 + torch_backend.CASCADE_MIN_SHARED + 16))
    suffixes = [[11, 12, 13], [21], [31, 32, 33, 34, 35]]
    p_slots = runner.allocator.alloc(len(prefix))
    runner.forward(runner.make_batch(ForwardMode.EXTEND, prefix, list(range(len(prefix))), p_slots, [p_slots],
                                     [len(prefix)], [len(prefix) - 1]))
    kv, ids, pos, out = [], [], [], []
    for suf in suffixes:
        own = runner.allocator.alloc(len(suf))
        if len(suf) > 1:  # all but the last suffix token go in by extend over the shared prefix
            n = len(suf) - 1
            runner.forward(runner.make_batch(
                ForwardMode.EXTEND, suf[:-1], list(range(len(prefix), len(prefix) + n)), own[:n],
                [torch.cat([p_slots, own[:n]])], [n], [n - 1]))
        kv.append(torch.cat([p_slots, own]))
        ids.append(suf[-1])
        pos.append(len(prefix) + len(suf) - 1)
        out.append(own[-1:])
    fb = runner.make_batch(ForwardMode.DECODE, ids, pos, torch.cat(out), kv, [1] * 3, [0, 1, 2])
    runner.attn_backend.init_forward_metadata(fb)
    assert fb.attn_metadata.shared is not None and fb.attn_metadata.shared.numel() == len(prefix)
    logits = runner.forward(fb)
    for i, suf in enumerate(suffixes):
        torch.testing.assert_close(logits[i], hf_logits(ref, prefix + suf)[-1], atol=ATOL, rtol=1e-4)


def test_batched_extend_over_shared_prefix_matches_transformers(make_tiny_model):
    """Extend of several requests over the same cached prefix slots (extend cascade path)."""
    from transformers import AutoModelForCausalLM

    from radixlm.runtime.attention import torch_backend

    folder = make_tiny_model("LlamaForCausalLM", seed=4)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(ServerArgs(model=str(folder), max_total_tokens=2048, max_running_requests=8))
    prefix = list(range(500, 500 + torch_backend.CASCADE_MIN_SHARED + 7))
    suffixes = [[11, 12, 13], [21], [31, 32, 33, 34, 35, 36]]
    p_slots = runner.allocator.alloc(len(prefix))
    runner.forward(runner.make_batch(ForwardMode.EXTEND, prefix, list(range(len(prefix))), p_slots, [p_slots],
                                     [len(prefix)], [len(prefix) - 1]))
    ids, pos, kv, lens, rows, new = [], [], [], [], [], []
    for suf in suffixes:
        own = runner.allocator.alloc(len(suf))
        ids += suf
        pos += range(len(prefix), len(prefix) + len(suf))
        kv.append(torch.cat([p_slots, own]))
        lens.append(len(suf))
        new.append(own)
        rows.append(len(ids) - 1)
    fb = runner.make_batch(ForwardMode.EXTEND, ids, pos, torch.cat(new), kv, lens, list(range(len(ids))))
    logits = runner.forward(fb)
    assert fb.attn_metadata.shared is not None and fb.attn_metadata.shared.numel() == len(prefix)
    start = 0
    for suf in suffixes:
        want = hf_logits(ref, prefix + suf)[len(prefix):]
        torch.testing.assert_close(logits[start : start + len(suf)], want, atol=ATOL, rtol=1e-4)
        start += len(suf)
