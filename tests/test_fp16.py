"""`--quantization fp16`: weights in half precision on fbgemm's fp16 GEMM, activations in float32."""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_cold_and_warm_equal, each_alone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from test_models import PROMPTS, decode_logits, hf_logits, our_logits

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.cpu import fp16 as hl
from radixlm.runtime.executor.cpu import quantization as quant
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.models.linear import Linear

pytestmark = pytest.mark.skipif(hl.fp16_unavailable() is not None, reason=f"fp16: {hl.fp16_unavailable()}")

ATOL = 1e-4  # as tests/test_models.py: float32 sums in another order than transformers'


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 120), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fp16_linear_is_the_float_product_of_the_rounded_weights(rows, k, n, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = hl.Fp16Linear(w, b)(x)
    want = x.double() @ _rounded(w).double().t() + (0 if b is None else b.double())
    # float32 sums of k products: within k float32 roundings of the exact value
    bound = 2 * k * 2**-24 * (x.abs().double() @ w.abs().double().t() + (0 if b is None else b.abs().double())) + 1e-30
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert bool(((got.double() - want).abs() <= bound).all())


@pytest.mark.parametrize("tied", [True, False])
def test_packing_on_threads_gives_the_layers_one_thread_gives(tied):
    """to_fp16 packs the matrices on a pool of threads: each layer lands where its float32 one was,
    with the same products, and a tied lm_head packs the embedding rows."""
    import copy

    from torch import nn

    gen = torch.Generator().manual_seed(3)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 24)
            self.blocks = nn.ModuleList(nn.ModuleDict({"a": Linear(24, 40, bias=True), "b": Linear(40, 24, bias=False)})
                                        for _ in range(4))
            self.tie_word_embeddings = tied
            if not tied:
                self.lm_head = Linear(24, 50, bias=False)

    model = Model()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    one, many = copy.deepcopy(model), copy.deepcopy(model)
    assert hl.to_fp16(one, threads=1) == hl.to_fp16(many, threads=3) == 9
    x = torch.randn(5, 24, generator=gen)
    for name, layer in one.named_modules():
        if isinstance(layer, hl.Fp16Linear):
            twin = many.get_submodule(name)
            assert isinstance(twin, hl.Fp16Linear) and (twin.in_features, twin.out_features) == (layer.in_features,
                                                                                                 layer.out_features)
            rows = torch.randn(5, layer.in_features, generator=gen)
            assert torch.equal(layer(rows), twin(rows)), name
    assert sum(isinstance(m, Linear) for m in many.modules()) == 0
    head = many.lm_head(x)
    source = model.embed_tokens.weight if tied else model.lm_head.weight
    assert torch.allclose(head, x @ _rounded(source).t(), atol=1e-4)
    assert torch.equal(many.embed_tokens(torch.tensor([3, 7])), _rounded(model.embed_tokens.weight[[3, 7]]))


def test_the_mode_is_validated_and_refused_where_it_cannot_run(make_tiny_model, monkeypatch):
    assert EngineArgs(model="x", quantization="fp16").quantization == "fp16"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(model="x", quantization="fp8")
    with pytest.raises(ValueError, match="fp16 runs float32 models on the CPU"):
        quant.resolve_quantization("fp16", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(quant, "fp16_unavailable", lambda: "this torch build has no fbgemm fp16 matmul")
    with pytest.raises(ValueError, match="cannot be used: this torch build has no fbgemm fp16"):
        quant.resolve_quantization("fp16", torch.device("cpu"), torch.float32)
    monkeypatch.undo()
    folder = make_tiny_model()
    with pytest.raises(ValueError, match="deterministic-inference cannot run fp16"):
        ModelRunner(EngineArgs(model=str(folder), quantization="fp16", enable_deterministic_inference=True,
                               max_total_tokens=256, max_running_requests=4))


def test_auto_is_fp16_on_the_cpu_unless_float32_matmuls_are_asked_for(make_tiny_model, monkeypatch):
    cpu = torch.device("cpu")
    assert EngineArgs(model="x").quantization == "auto"
    assert quant.resolve_quantization("auto", cpu, torch.float32) == "fp16"
    assert quant.resolve_quantization("auto", cpu, torch.float32, float_matmuls=True) == "none"
    assert quant.resolve_quantization("auto", cpu, torch.bfloat16) == "none"
    assert quant.resolve_quantization("auto", torch.device("cuda"), torch.float32) == "none"
    folder = str(make_tiny_model())
    small = dict(model=folder, max_total_tokens=256, max_running_requests=4)
    assert ModelRunner(EngineArgs(**small)).quantization == "fp16"
    assert ModelRunner(EngineArgs(cpu_gemm="onednn", **small)).quantization == "fp16"  # no option changes another
    assert ModelRunner(EngineArgs(enable_deterministic_inference=True, **small)).quantization == "none"
    monkeypatch.setattr(quant, "fp16_unavailable", lambda: "no fbgemm")
    assert ModelRunner(EngineArgs(**small)).quantization == "none"  # where fp16 cannot run: float32, no error


@pytest.mark.parametrize("tied", [False, True])
def test_fp16_model_matches_transformers_on_the_rounded_weights(make_tiny_model, tied):
    """Every matmul (the lm_head too) and the embeddings in fp16; logits at every position and of a
    batched decode equal transformers' with its weights rounded to fp16 the same way."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tie_word_embeddings=tied, seed=3)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:  # matmul weights and embeddings; norms stay float32, as ours do
                p.copy_(_rounded(p))
    args = dict(model=str(folder), max_total_tokens=1024, max_running_requests=8)
    runner = ModelRunner(EngineArgs(quantization="fp16", **args))
    float_runner = ModelRunner(EngineArgs(quantization="none", **args))
    model = runner.model
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert sum(isinstance(m, hl.Fp16Linear) for m in model.modules()) == 2 * 4 + 1  # qkv, o, gate_up, down; head
    assert isinstance(model.embed_tokens, hl.Fp16Embedding) and runner.attn_backend.name == "torch"
    half, whole = quant.resident_weight_bytes(model), quant.resident_weight_bytes(float_runner.model)
    assert 0.45 * whole < half < 0.55 * whole + (0.5 * whole if tied else 0)  # tied: the head is a second copy
    for p, got in zip(PROMPTS, our_logits(runner, PROMPTS)):
        torch.testing.assert_close(got, hf_logits(ref, p), atol=ATOL, rtol=1e-4)
    longer = [p for p in PROMPTS if len(p) > 1]
    dec = decode_logits(runner, longer)
    for i, p in enumerate(longer):
        torch.testing.assert_close(dec[i], hf_logits(ref, p)[-1], atol=ATOL, rtol=1e-4)
    assert runner.allocator.num_free == 1024


@pytest.fixture(scope="module")
def fp16_engine(smollm_folder):
    from radixlm.runtime import Engine

    with Engine(model=str(smollm_folder), quantization="fp16", max_total_tokens=8192, log_level="warning") as e:
        yield e


@pytest.mark.slow
def test_fp16_engine_answers_alike_alone_batched_cold_and_warm(fp16_engine, engine, tokenizer):
    """SmolLM2 in fp16: each prompt alone equals it in a batch and from the cache, and greedy text stays
    float32's on these prompts (fp16 weights move logits by ~1e-3)."""
    prompts = ["The capital of France is", "def fib(n):\n    return", "List three colours:",
               "The quick brown fox jumps over the lazy dog. The quick"]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    alone = each_alone(fp16_engine, prompts, params)
    assert_cold_and_warm_equal(fp16_engine, prompts, params, alone)
    assert alone == [o["output_ids"] for o in engine.generate(prompts, params)]
    lp = fp16_engine.generate(prompts[0], {"temperature": 0, "max_new_tokens": 1}, return_logprob=True,
                              logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    ref = engine.generate(prompts[0], {"temperature": 0, "max_new_tokens": 1}, return_logprob=True,
                          logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    assert max(abs(a[0] - b[0]) for a, b in zip(lp[1:], ref[1:])) < 0.05


@pytest.mark.slow
def test_compiled_fp16_forward_matches_the_eager_one(make_tiny_model):
    from radixlm.runtime import Engine

    folder = make_tiny_model(seed=5)
    ids = [[1, 5, 9, 200, 3000, 17, 42, 7], [100, 101, 102]]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    got = {}
    for compiled in (False, True):
        with Engine(model=str(folder), quantization="fp16", enable_torch_compile=compiled, max_total_tokens=512,
                    log_level="warning") as e:
            if compiled:
                assert e.runner.compiled is not None and e.runner.compiled.graphs() == 1
            got[compiled] = e.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                                       logprob_start_len=0)
    for a, b in zip(got[False], got[True]):
        lp_a = [x[0] for x in a["meta_info"]["input_token_logprobs"][1:]]
        lp_b = [x[0] for x in b["meta_info"]["input_token_logprobs"][1:]]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-3
