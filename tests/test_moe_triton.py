"""The fused MoE Triton kernel (models/moe_triton.py) against the torch MoE (moe.grouped_experts):
on the CPU under the Triton interpreter, natively where a GPU is. Tokens, experts and top-k drawn by
hypothesis, experts that get no tokens and experts that get them all, float32 and bfloat16."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis_budget import examples

pytest.importorskip("triton")
from radixlm.runtime.executor.models import moe_triton  # noqa: E402
from radixlm.runtime.executor.models.moe import SparseMoE, grouped_experts  # noqa: E402

if not moe_triton.INTERPRET and not torch.cuda.is_available():
    pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1 before triton loads", allow_module_level=True)
DEVICE = "cuda" if not moe_triton.INTERPRET else "cpu"


@settings(max_examples=examples(25), deadline=None)
@given(tokens=st.integers(0, 70), experts=st.integers(1, 9), hidden=st.sampled_from([16, 40]),
       inter=st.sampled_from([16, 24]), data=st.data(), seed=st.integers(0, 2**16))
def test_fused_experts_equal_the_torch_moe(tokens, experts, hidden, inter, data, seed):
    top_k = data.draw(st.integers(1, experts))
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoE(hidden, inter, experts, top_k, normalize=data.draw(st.booleans()))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(tokens, hidden, generator=gen)
    if tokens and data.draw(st.booleans()):  # every token alike: one set of experts takes them all
        x[:] = x[0]
    weights, ids = moe.route(x)
    want = grouped_experts(x, moe.w13.data, moe.w2.data, ids, weights)
    got = moe_triton.fused_experts(x.to(DEVICE), moe.w13.data.to(DEVICE), moe.w2.data.to(DEVICE), ids.to(DEVICE),
                                   weights.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


def test_bfloat16_experts_match_within_bfloat16():
    gen = torch.Generator().manual_seed(1)
    moe = SparseMoE(32, 16, 4, 2, normalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(33, 32, generator=gen)
    weights, ids = moe.route(x)
    want = grouped_experts(x, moe.w13.data, moe.w2.data, ids, weights)
    bf = [t.to(DEVICE, torch.bfloat16) for t in (x, moe.w13.data, moe.w2.data)]
    got = moe_triton.fused_experts(bf[0], bf[1], bf[2], ids.to(DEVICE), weights.to(DEVICE))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), want, atol=0.05, rtol=0.05)


def test_align_groups_every_pair_once_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    pairs, block_expert = moe_triton.align(ids, 4)
    m = moe_triton.BLOCK_M
    real = pairs[pairs < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))
    for b, e in enumerate(block_expert.tolist()):
        block = pairs[b * m:(b + 1) * m]
        block = block[block < ids.numel()]
        assert (e < 0) == (block.numel() == 0)
        assert all(ids.flatten()[p].item() == e for p in block.tolist())
    assert 3 not in block_expert.tolist()  # an expert with no pairs has no block


def test_moe_decode_through_the_graph_runner_gives_the_eager_tokens(make_tiny_model, monkeypatch):
    """A model with routed experts records CUDA graphs (its experts run as the fused kernels, which read
    nothing back to the host): through the graph runner's static buffers (its eager twin, the fused
    experts on the CPU under the interpreter) its greedy tokens are the plain eager ones. torch.compile
    still refuses it on the CPU, where the grouped experts read their counts on the host."""
    from radixlm.runtime import Engine
    from radixlm.runtime.executor.cuda_graph import EAGER_ENV

    monkeypatch.setattr(SparseMoE, "forward", lambda self, x: moe_triton.fused_experts(
        x, self.w13, self.w2, *reversed(self.route(x))))
    folder = make_tiny_model("Qwen3MoeForCausalLM", seed=5, initializer_range=0.2, head_dim=32, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])
    prompts = [list(range(100, 120)), list(range(130, 137)), [5, 6]]
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    outputs = []
    for graphs in (False, True):
        monkeypatch.setenv(EAGER_ENV, "1" if graphs else "0")
        with Engine(model=str(folder), max_total_tokens=1024, max_running_requests=4, context_length=64,
                    device=DEVICE, dtype="float32", log_level="warning") as engine:
            model = engine.runner.model
            assert model.graph_safe and not model.compile_safe
            outputs.append([o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)])
            runner = engine.runner.graph_runner
            assert (runner is not None and runner.replays > 0) == (graphs or DEVICE == "cuda")
    assert outputs[1] == outputs[0]
    with pytest.raises(ValueError, match="enable-torch-compile"):
        Engine(model=str(folder), enable_torch_compile=True, max_total_tokens=1024, log_level="warning")
