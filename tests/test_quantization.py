"""`--quantization int8` (cpu/int8.py, executor/cpu/quantization.py): the library kernels
compute the documented formula exactly, and a row's output never depends on the rest of its batch (op
and engine: alone vs in a batch of 8, cache cold and warm, chunked, retracted, cache off). The cache
file of quantized weights: tests/test_quantized_cache.py."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F
from engine_checks import (
    INVARIANT_OPTION_IDS,
    INVARIANT_OPTIONS,
    assert_cold_and_warm_equal,
    assert_options_keep_answers,
    assert_prefill_is_batch_invariant,
    each_alone,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.cpu import int8 as ql
from radixlm.runtime.executor.cpu import quantization as quant

CPU = torch.device("cpu")
KERNEL = ql.choose_kernel()
needs_int8 = pytest.mark.skipif(isinstance(KERNEL, str), reason=f"no int8 kernel here: {KERNEL}")
WORKING = [k for k in ql.KERNELS.values() if ql._probe(k) is None]
# a second kernel that can take products of MANY_ROWS rows and more beside KERNEL (on a CPU without
# AMX `auto` packs once; the tests below pair the kernels anyway, wherever two work)
SECOND = next((k for k in WORKING if not isinstance(KERNEL, str) and k is not KERNEL), None)
needs_two = pytest.mark.skipif(SECOND is None, reason="needs two working int8 kernels")
SHAPES = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _operands(seed: int, rows: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, k // 2] *= 40.0  # an outlier channel, as LLM activations have
    if rows > 2:
        x[1] = 0.0  # an all-zero row quantizes to zeros
    return x, torch.randn(n, k, generator=gen) * 0.05


# ------------------------------------------------------------------------------------------ the op


def test_options_are_validated():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization="int3")
    with pytest.raises(ValueError, match="int8_batch_packing must be one of"):
        EngineArgs(quantization="int8", int8_batch_packing="twice")
    with pytest.raises(ValueError, match="float32 models on the CPU"):
        quant.resolve_quantization("int8", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="float32 models on the CPU"):
        quant.resolve_quantization("int8", torch.device("cuda"), torch.float32)
    assert quant.resolve_quantization("none", torch.device("cuda"), torch.bfloat16) == "none"


def test_a_kernel_that_saturates_or_fails_is_never_chosen(monkeypatch):
    def saturating(xq, packed):  # what a u8 x s8 16-bit pair sum does without VNNI
        return ql.exact_matmul(xq.clamp(-64, 63), *packed)

    def missing(qweight, scale):
        raise RuntimeError("no such op")

    bad = ql.Int8Kernel("bad", lambda q, s: (q, s), saturating, lambda n, k: n * k)
    gone = ql.Int8Kernel("gone", missing, saturating, lambda n, k: n * k)
    monkeypatch.setattr(ql, "KERNELS", {"bad": bad, "gone": gone})
    ql.choose_kernel.cache_clear()
    try:
        why_not = ql.choose_kernel()
        assert isinstance(why_not, str) and "not exact" in why_not and "no such op" in why_not
        with pytest.raises(ValueError, match="not exact"):
            quant.resolve_quantization("int8", CPU, torch.float32)
        if WORKING:
            monkeypatch.setattr(ql, "KERNELS", {"bad": bad, WORKING[-1].name: WORKING[-1]})
            ql.choose_kernel.cache_clear()
            assert ql.choose_kernel() is WORKING[-1]
    finally:
        ql.choose_kernel.cache_clear()


def _pair_saturating(xq: torch.Tensor, qweight: torch.Tensor, zero: int) -> torch.Tensor:
    """xq @ qweight.T as a CPU without VNNI computes it: u8 (xq + zero) times s8 in pairs of adjacent
    columns, each pair's sum saturated to 16 bits (vpmaddubsw), the zero point's share taken off after."""
    raw, w = xq + zero, qweight.double()
    if raw.shape[1] % 2:
        raw, w = F.pad(raw, (0, 1)), F.pad(w, (0, 1))
    products = raw.double()[:, None, :] * w[None, :, :]  # [M, N, K]
    pairs = products.view(*products.shape[:2], -1, 2).sum(-1).clamp_(-32768, 32767)
    return (pairs.sum(-1) - zero * w.sum(1)[None, :]).float()


def test_where_pairs_saturate_the_split_kernel_gives_the_formula(monkeypatch):
    """On a CPU whose kernel saturates 16-bit pair sums (simulated) the full-range kernel fails the
    probe and its split form, which feeds it halves of each row, is chosen; the split form equals the
    formula bit for bit, on layers wider than one packed block too."""
    full = ql.Int8Kernel("sim", lambda q, s: (q, s), lambda xq, p: _pair_saturating(xq, p[0], 128) * p[1],
                         lambda n, k: n * k)
    split = ql._split("sim-split", lambda q, ones: q, lambda x, q: _pair_saturating(x.round(), q, 64),
                       lambda n, k: n * k)
    monkeypatch.setattr(ql, "KERNELS", {"sim": full, "sim-split": split})
    ql.choose_kernel.cache_clear()
    try:
        assert ql.choose_kernel() is split
        assert "not exact" in ql._probe(full)
    finally:
        ql.choose_kernel.cache_clear()
    gen = torch.Generator().manual_seed(5)
    for k in (96, ql.SPLIT_COLUMNS + 40):
        qweight = torch.randint(-127, 128, (6, k), generator=gen, dtype=torch.int8)
        qweight[0] = 127
        xq = torch.randint(-127, 128, (3, k), generator=gen).float()
        xq[0] = 127  # row 0 times weight row 0: 127 x 127 x k, past 2**24 on the wide layer
        scale = torch.rand(6, generator=gen) + 0.5
        want = ql.exact_matmul(xq, qweight, scale)
        assert not torch.equal(full.matmul(xq, full.pack(qweight, scale)), want)
        assert torch.equal(split.matmul(xq, split.pack(qweight, scale)), want), k


@needs_int8
@SHAPES
@given(rows=st.integers(1, 48), k=st.integers(2, 160), n=st.integers(1, 96), seed=st.integers(0, 2**16))
def test_kernels_compute_the_formula_exactly(rows, k, n, seed):
    """Every working kernel equals the float64 formula bit for bit (int32 sums are exact), so the
    kernels agree with each other and with any blocking of the batch."""
    x, w = _operands(seed, rows, k, n)
    qweight, scale = ql.quantize_weight(w)
    xq, s = ql.quantize_rows(x)
    assert xq.abs().max() <= ql.QMAX and torch.equal(xq, xq.round())
    want = ql.exact_matmul(xq, qweight, scale)
    for kernel in WORKING:
        assert torch.equal(kernel.matmul(xq, kernel.pack(qweight, scale)), want), kernel.name


@pytest.mark.skipif(not any(k.name.startswith("fbgemm") for k in WORKING),
                    reason="fbgemm's int8 kernel is not in this build")
def test_fbgemm_is_called_without_asking_its_packed_weights_for_torch_function(monkeypatch):
    """torch asks a TorchBind argument for `__torch_function__` and the object answers with a C++
    exception thrown and caught inside the call, which cost more than a small layer's product: the call
    runs with subclass dispatch off, and still gives the formula's bits."""
    seen = []
    real = ql._FBGEMM_LINEAR

    def spy(*args):
        seen.append(torch._C._is_torch_function_enabled())
        return real(*args)

    monkeypatch.setattr(ql, "_FBGEMM_LINEAR", spy)
    qweight, scale = ql.quantize_weight(torch.randn(24, 40))
    xq, _ = ql.quantize_rows(torch.randn(3, 40))
    kernel = next(k for k in WORKING if k.name.startswith("fbgemm"))
    assert torch.equal(kernel.matmul(xq, kernel.pack(qweight, scale)), ql.exact_matmul(xq, qweight, scale))
    assert seen == [False]
    assert torch._C._is_torch_function_enabled()  # only for the call


@needs_int8
@SHAPES
@given(rows=st.integers(1, 40), k=st.integers(2, 160), n=st.integers(1, 96), seed=st.integers(0, 2**16),
       bias=st.booleans(), smooth=st.booleans())
def test_int8_linear_is_within_the_rounding_bound_of_float32(rows, k, n, seed, bias, smooth):
    """Round-to-nearest leaves each operand within half a step (s/2) of its value, so
    |y - y_int8| <= sum_k |x_k| s_w/2 + |w_k| s_x/2 + s_x s_w/4, plus float32 rounding."""
    x, w = _operands(seed, rows, k, n)
    b = torch.randn(n) if bias else None
    c = torch.rand(k) + 0.5 if smooth else torch.ones(k)
    qweight, w_scale = ql.quantize_weight(w * c)
    layer = ql.Int8Linear(qweight, w_scale, b, KERNEL, c.reciprocal() if smooth else None)
    got, want = layer(x), F.linear(x, w, b)
    xs, ws = x / c, w * c  # the operands that are quantized (xs @ ws.T == x @ w.T)
    s_x, s_w = xs.abs().amax(1, keepdim=True) / ql.QMAX, w_scale[None, :]
    bound = (xs.abs().sum(1, keepdim=True) * s_w / 2 + s_x * ws.abs().sum(1)[None, :] / 2 + k * s_x * s_w / 4
             + 1e-5 * (x.abs() @ w.abs().t()) + 1e-6)
    assert torch.all((got - want).abs() <= bound)


@needs_int8
@SHAPES
@given(rows=st.integers(2, 40), k=st.integers(2, 160), n=st.integers(1, 96), seed=st.integers(0, 2**16))
def test_a_row_alone_equals_the_row_in_its_batch(rows, k, n, seed):
    x, w = _operands(seed, rows, k, n)
    layer = ql.Int8Linear(*ql.quantize_weight(w), None, KERNEL)
    batch = layer(x)
    for r in range(rows):
        assert torch.equal(layer(x[r:r + 1]), batch[r:r + 1])
    assert torch.equal(layer(x[rows // 2:]), batch[rows // 2:])


@needs_two
@SHAPES
@given(rows=st.integers(1, 3 * ql.MANY_ROWS), k=st.integers(2, 160), n=st.integers(1, 96),
       seed=st.integers(0, 2**16), bias=st.booleans())
def test_a_second_packing_gives_the_same_bits_and_takes_only_the_many_row_products(rows, k, n, seed, bias):
    """A layer packed twice runs products of fewer than MANY_ROWS rows on its first kernel and the
    rest on the second; either way every row has the bits of the one-kernel layer, alone or batched."""
    x, w = _operands(seed, rows, k, n)
    qweight, scale = ql.quantize_weight(w)
    b = torch.randn(n) if bias else None
    calls = []

    def counted(kernel: ql.Int8Kernel) -> ql.Int8Kernel:
        def matmul(xq, packed):
            calls.append((kernel.name, xq.shape[0]))
            return kernel.matmul(xq, packed)

        def raw(halves, packed):  # a split kernel's product: on both halves of each row
            calls.append((kernel.name, halves.shape[0] // 2))
            return kernel.raw(halves, packed)
        return dataclasses.replace(kernel, matmul=matmul, raw=None if kernel.raw is None else raw)

    one = ql.Int8Linear(qweight, scale, b, KERNEL)
    two = ql.Int8Linear(qweight, scale, b, counted(KERNEL), many=counted(SECOND))
    assert two.nbytes == one.nbytes + SECOND.packed_bytes(n, k)
    batch = two(x)
    assert calls == [(SECOND.name if rows >= ql.MANY_ROWS else KERNEL.name, rows)]
    assert torch.equal(batch, one(x))
    for r in range(0, rows, max(1, rows // 4)):
        assert torch.equal(two(x[r:r + 1]), batch[r:r + 1])
    assert calls[1][0] == KERNEL.name  # one row: the first kernel


def test_the_second_packing_is_chosen_by_the_cpu_and_can_be_turned_off(monkeypatch):
    few = next(iter(ql.KERNELS.values()))
    assert ql.choose_many_kernel("off", few) is None
    monkeypatch.setattr(ql, "_has_amx", lambda: False)
    assert ql.choose_many_kernel("auto", few) is None  # no AMX: oneDNN gains too little to pay a second copy
    monkeypatch.setattr(ql, "_has_amx", lambda: True)
    k = ql.KERNELS

    def working(name):
        return k[name] if ql._probe(k[name]) is None else None
    assert ql.choose_many_kernel("auto", k["fbgemm"]) is working("onednn")  # never a split one beside a whole one
    assert ql.choose_many_kernel("auto", k["fbgemm-split"]) is working("onednn-split")
    assert ql.choose_many_kernel("auto", k["onednn"]) is None  # never the first kernel again
    assert ql.choose_many_kernel("auto", k["onednn-split"]) is None


# ------------------------------------------------------------------------------------------ engines


QUESTIONS = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.", "hi",
             "What is the capital of France? Answer in one word.", "List the planets of the solar system.",
             "Explain recursion to a child in two sentences.", "Translate 'good morning' into Spanish."]
GREEDY = {"temperature": 0, "max_new_tokens": 20}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in QUESTIONS]


def _fast(kernel) -> bool:
    """Whether `kernel` takes an 8-row product of SmolLM2's qkv shape in under 2 ms here. oneDNN's int8
    took 150 ms on an AMD CPU while it was given int8 activations without AMX (its reference kernel): on
    a kernel that slow the engines below would run for hours."""
    gen = torch.Generator().manual_seed(0)
    packed = kernel.pack(torch.randint(-127, 128, (960, 576), generator=gen, dtype=torch.int8), torch.ones(960))
    xq = torch.randint(-127, 128, (8, 576), generator=gen).float()
    kernel.matmul(xq, packed)
    start = time.perf_counter()
    kernel.matmul(xq, packed)
    return time.perf_counter() - start < 2e-3


PAIRED = SECOND is not None and _fast(SECOND)  # the engines below pack twice


@pytest.fixture(scope="module", autouse=True)
def packed_twice_wherever_two_kernels_work():
    """The engines below pack their weights twice (`auto` on a CPU with AMX) wherever two kernels
    work at speed, so each comparison also puts a prompt alone (one-row decodes, first kernel)
    against it in a batch (8-row decodes and prefills, second kernel)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ql, "_has_amx", lambda: PAIRED)
        yield


@pytest.fixture(scope="module")
def int8_engine(smollm_folder):
    if isinstance(KERNEL, str):
        pytest.skip(KERNEL)
    from radixlm.runtime import Engine

    # deterministic inference: the batch-invariant attention (int8 matmuls are exact per row on their own)
    with Engine(model=str(smollm_folder), quantization="int8", enable_deterministic_inference=True,
                max_total_tokens=8192, log_level="warning") as e:
        yield e


@pytest.fixture(scope="module")
def alone(int8_engine, prompts):
    """Each prompt greedy on its own, the cache flushed before each."""
    return each_alone(int8_engine, prompts, GREEDY)


@pytest.mark.slow
def test_int8_prefill_is_bitwise_batch_invariant(int8_engine, prompts):
    """Prompts prefilled alone or 8 together (one forward of all their tokens, the cache cold): the
    same logprobs to the last bit for every prompt token and the first new one."""
    assert_prefill_is_batch_invariant(int8_engine, prompts)


# The int8 matmuls are exact per row (above); attention is made so by the invariant backend, which
# --enable-deterministic-inference selects (the torch backend's decode pads every row's keys to the
# batch's longest and a cached or chunked prefill takes another SDPA path: float32 absorbs those
# last-bit differences, per-token int8 rounding can turn one into a different token).


@pytest.mark.slow
def test_int8_batch_of_8_equals_each_prompt_alone_cold_and_warm(int8_engine, prompts, alone):
    assert int8_engine.runner.matmuls.startswith("int8")
    assert (not PAIRED) or int8_engine.runner.matmuls.endswith(f"{SECOND.name} from {ql.MANY_ROWS} rows)")
    assert int8_engine.runner.attn_backend.name == "invariant"  # deterministic inference picks it
    assert_cold_and_warm_equal(int8_engine, prompts, GREEDY, alone)


SYSTEM = ("You are a careful assistant for a library. " * 4 + "Answer in one short sentence, name the "
          "shelf where a reader finds the book, and never invent a title. ") * 3


@pytest.mark.slow
def test_int8_clients_behind_one_system_prompt_equal_each_alone(int8_engine, tokenizer):
    """The trace's first wave: prompts behind the same long system prompt, sent at once with the cache
    cold. The first is prefilled whole, the others' suffixes then extend together behind the cached
    prompt, its blocks scored once for all of them (invariant_backend._extend_shared); each answer
    equals the prompt's own run."""
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                             tokenize=False, add_generation_prompt=True) for q in QUESTIONS[:5]]
    assert len(tokenizer(prompts[0]).input_ids) > 3 * 64  # three whole shared blocks at least
    backend, seen = int8_engine.runner.attn_backend, []
    plan = backend._extend_plan
    backend._extend_plan = lambda batch: seen.append(plan(batch)) or seen[-1]
    try:
        alone = []
        for p in prompts:
            int8_engine.flush_cache()
            alone.append(int8_engine.generate(p, GREEDY)["output_ids"])
        seen.clear()
        assert_cold_and_warm_equal(int8_engine, prompts, GREEDY, alone)
    finally:
        del backend._extend_plan
    assert any(p.shared is not None and len(p.chunks) >= 4 for p in seen), "no step extended behind the shared prompt"


@pytest.mark.slow
def test_what_decodes_keep_of_their_gathers_never_changes_a_logprob(int8_engine, prompts, tokenizer, monkeypatch):
    """Consecutive decodes keep the shared blocks' and each row's own K/V (decode_kv.py) through real
    steps: rows finishing at different times, a batch behind a shared system prompt. Every output
    logprob equals that of a run that gathers everything every step, to the bit."""
    from radixlm.runtime.executor.attention import decode_kv

    behind = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                            tokenize=False, add_generation_prompt=True) for q in QUESTIONS[:4]]
    params = {**GREEDY, "max_new_tokens": 24}

    def run() -> list:
        int8_engine.flush_cache()
        out = int8_engine.generate(prompts + behind, params, return_logprob=True)
        return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in out]

    kept = run()
    assert int8_engine.runner.attn_backend._own_kv is not None  # the last decode kept its rows' keys
    monkeypatch.setattr(decode_kv, "KEPT_KV_BYTES", 0)
    assert run() == kept


@pytest.mark.slow
@pytest.mark.parametrize("options", INVARIANT_OPTIONS, ids=INVARIANT_OPTION_IDS)
def test_int8_answers_do_not_depend_on_chunks_retraction_or_the_cache(smollm_folder, prompts, alone, options):
    from radixlm.runtime import Engine

    with Engine(model=str(smollm_folder), quantization="int8", enable_deterministic_inference=True,
                log_level="warning", **options) as e:
        assert_options_keep_answers(e, options, prompts, GREEDY, alone)
