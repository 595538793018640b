"""The fused layer kernels (models/triton_layer_ops.py) against the torch ops they replace: on the CPU
under the Triton interpreter, natively where a GPU is. Rows, widths, heads (GQA, the built-in model's
9 over 3), partial rotary dims, scattered pool slots and float32 / bfloat16 / float16 are drawn by
hypothesis; float32 agrees to a few ulps, half precision to the rounding of one result (the
interpreter truncates float32 to bfloat16 where a GPU rounds to nearest: one ulp more there)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis_budget import examples

pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from radixlm.runtime.executor.models import triton_layer_ops as ops  # noqa: E402
from radixlm.runtime.executor.models.llama import RotaryEmbedding  # noqa: E402

if not knobs.runtime.interpret and not torch.cuda.is_available():
    pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1 before triton loads", allow_module_level=True)
DEVICE = "cpu" if knobs.runtime.interpret else "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: a few ulps of the values (about 1); half precision: one rounding of the result
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@settings(max_examples=examples(25), deadline=None)
@given(rows=st.integers(0, 9), n=st.sampled_from([8, 64, 96, 576, 1000]), dtype=st.sampled_from(DTYPES),
       with_delta=st.booleans(), seed=st.integers(0, 2**16))
def test_add_rms_norm_is_the_add_then_the_norm(rows, n, dtype, with_delta, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    delta = (torch.randn(rows, n, generator=gen)).to(dtype) if with_delta else None
    weight = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    total, out = ops.add_rms_norm(x.to(DEVICE), None if delta is None else delta.to(DEVICE), weight.to(DEVICE), 1e-5)
    want_total = x if delta is None else x + delta  # rounded to the dtype, as the unfused layer's add
    if dtype == torch.bfloat16 and knobs.runtime.interpret:  # the interpreter truncates to bfloat16
        torch.testing.assert_close(total.cpu(), want_total, atol=0, rtol=2**-7)
    else:  # the carried sum is exactly the unfused one
        assert torch.equal(total.cpu(), want_total)
    h = want_total.float()
    want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()
    close(out, want, dtype)
    assert out.dtype == dtype and total.dtype == dtype


@settings(max_examples=examples(25), deadline=None)
@given(rows=st.integers(0, 7), inter=st.sampled_from([8, 24, 1536, 1100]), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_silu_mul_is_silu_of_gate_times_up(rows, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    got = ops.silu_mul(gate_up.to(DEVICE))
    gate, up = gate_up.float().split(inter, dim=-1)
    close(got, F.silu(gate) * up, dtype)


@settings(max_examples=examples(25), deadline=None)
@given(tokens=st.integers(0, 6), shape=st.sampled_from([(4, 4, 64), (8, 2, 64), (9, 3, 64), (4, 2, 96), (6, 1, 128)]),
       partial=st.sampled_from([1.0, 0.75, 0.5]), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_rope_store_rotates_q_and_writes_k_and_v_to_their_slots(tokens, shape, partial, dtype, seed):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(dim, 512, 10000.0, {"partial_rotary_factor": partial} if partial < 1 else {})
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    tables = rope.tables(positions, dtype)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    num_slots = 40
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    pool_k = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    pool_v = torch.randn(num_slots, kv_heads, dim, generator=gen).to(dtype)
    want_k, want_v = pool_k.clone(), pool_v.clone()
    # the unfused layer: rotate in float32 (then one rounding, as the kernel), write with index_copy_
    rotated = rope(tuple(t.float() for t in tables), qkv[:, :heads + kv_heads].float())
    want_k.index_copy_(0, slots, rotated[:, heads:].to(dtype))
    want_v.index_copy_(0, slots, qkv[:, heads + kv_heads:])
    k, v = pool_k.to(DEVICE), pool_v.to(DEVICE)
    q = ops.rope_store(qkv.to(DEVICE), *(t.to(DEVICE) for t in tables), heads, kv_heads, slots.to(DEVICE), k, v)
    close(q, rotated[:, :heads], dtype)
    close(k, want_k, dtype)
    assert torch.equal(v.cpu(), want_v)  # values are copied, never rounded
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k.cpu()[untouched], pool_k[untouched])


def test_rope_store_reads_a_strided_view_of_the_projection():
    """The model hands the kernel a view of its projection output; heads of a token are read by their
    own stride, and a Qwen3-style concatenation (q and k normalized, v as it was) too."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 6, 2, 64, 3
    rope = RotaryEmbedding(dim, 64, 10000.0, {})
    tables = rope.tables(torch.tensor([0, 5, 63]), torch.float32)
    padded = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 7, generator=gen).to(DEVICE)
    qkv = padded[:, :-7].unflatten(1, (heads + 2 * kv_heads, dim))  # rows 7 values apart from each other
    assert not qkv.is_contiguous()
    k = torch.zeros(4, kv_heads, dim, device=DEVICE)
    v = torch.zeros(4, kv_heads, dim, device=DEVICE)
    slots = torch.tensor([3, 0, 2], device=DEVICE)
    q = ops.rope_store(qkv, *(t.to(DEVICE) for t in tables), heads, kv_heads, slots, k, v)
    rotated = rope(tables, qkv.cpu()[:, :heads + kv_heads])
    close(q, rotated[:, :heads], torch.float32)
    close(k[slots], rotated[:, heads:], torch.float32)
    assert torch.equal(v[slots].cpu(), qkv.cpu()[:, heads + kv_heads:])
    assert not k[1].any() and not v[1].any()


@pytest.mark.parametrize("arch, overrides", [
    ("Qwen3ForCausalLM", {"head_dim": 32}),  # q and k normalized per head before RoPE
    ("Phi3ForCausalLM", {"pad_token_id": 0, "partial_rotary_factor": 0.75}),  # the dims past 24 not rotated
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                             "mlp_only_layers": [1]}),  # a routed layer, then a dense one (silu_mul)
])
def test_models_on_the_fused_ops_give_the_torch_backends_tokens_and_logprobs(make_tiny_model, arch, overrides):
    """A model on the Triton backend runs its layers on these kernels (K/V written by rope_store, the
    attention reading the pool only) and gives the torch backend's greedy tokens and their logprobs
    (to float32's rounding): a cached prefix extended and decoded behind, and a prompt alone."""
    from radixlm.runtime import Engine

    folder = make_tiny_model(arch, seed=11, initializer_range=0.2, **overrides)
    prefix = list(range(100, 140))
    prompts = [prefix + [7, 8, 9], prefix + [11], [42, 43]]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    outputs = []
    for name in ("torch", "triton"):
        with Engine(model=str(folder), attention_backend=name, max_total_tokens=512, max_running_requests=4,
                    context_length=64, device=DEVICE, dtype="float32", log_level="warning") as engine:
            assert engine.runner.model.fused_ops == (name == "triton")
            first = engine.generate(input_ids=prompts[:1], sampling_params=params, return_logprob=True)
            rest = engine.generate(input_ids=prompts[1:], sampling_params=params, return_logprob=True)
            outputs.append([(o["output_ids"], [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]])
                            for o in first + rest])
    assert [ids for ids, _ in outputs[1]] == [ids for ids, _ in outputs[0]]
    for (_, got), (_, want) in zip(outputs[1], outputs[0], strict=True):
        assert got == pytest.approx(want, abs=1e-4)
