"""`--enable-torch-compile` on the CPU (executor/compiled_forward.py): one compiled graph serves every
batch, a row's answer never depends on the rest of its batch, on the cache, on chunking or on
retraction (as in eager int8 mode), the compiled forward computes what the eager one does, and a
graph that would have to be compiled again is refused instead."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_checks import (
    INVARIANT_OPTION_IDS,
    INVARIANT_OPTIONS,
    assert_cold_and_warm_equal,
    assert_options_keep_answers,
    assert_prefill_is_batch_invariant,
    each_alone,
)

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.cpu import int8 as ql

KERNEL = ql.choose_kernel()
needs_int8 = pytest.mark.skipif(isinstance(KERNEL, str), reason=f"no int8 kernel here: {KERNEL}")

QUESTIONS = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.", "hi",
             "What is the capital of France? Answer in one word.", "List the planets of the solar system.",
             "Explain recursion to a child in two sentences.", "Translate 'good morning' into Spanish."]
GREEDY = {"temperature": 0, "max_new_tokens": 20}


def test_the_flag_is_sglangs():
    parser = __import__("argparse").ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli(parser.parse_args(["--enable-torch-compile"])).enable_torch_compile
    assert not EngineArgs().enable_torch_compile


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True) for q in QUESTIONS]


@pytest.fixture(scope="module")
def engine(smollm_folder):
    if isinstance(KERNEL, str):
        pytest.skip(KERNEL)
    from radixlm.runtime import Engine

    with Engine(model=str(smollm_folder), quantization="int8", enable_torch_compile=True, max_total_tokens=8192,
                enable_deterministic_inference=True, log_level="warning") as e:
        assert e.runner.compiled is not None and e.runner.compiled.graphs() == 1
        yield e


@pytest.fixture(scope="module")
def alone(engine, prompts):
    """Each prompt greedy on its own (one-row decodes), the cache flushed before each."""
    return each_alone(engine, prompts, GREEDY)


@needs_int8
@pytest.mark.slow
def test_compiled_prefill_is_bitwise_batch_invariant(engine, prompts):
    """Prompts prefilled alone or 8 together (one forward of all their tokens): the same logprobs to the
    last bit for every prompt token and the first new one."""
    assert_prefill_is_batch_invariant(engine, prompts)


@needs_int8
@pytest.mark.slow
def test_compiled_batch_of_8_equals_each_prompt_alone_cold_and_warm(engine, prompts, alone):
    assert_cold_and_warm_equal(engine, prompts, GREEDY, alone)
    # decodes of 1 to 8 rows, prefills of one token to hundreds: still the warm-up's one graph
    assert engine.runner.compiled.graphs() == 1


@needs_int8
@pytest.mark.slow
def test_compiled_int8_is_as_close_to_float32_as_eager_int8(engine, smollm_folder):
    """The compiled forward computes the eager forward's numbers but not their last bits (a norm's
    sums in another order), which per-token int8 rounding then widens: so each is compared with the
    float32 model on the whole quality text (2,847 tokens). The compiled run is as close to it as the
    eager int8 run, and its mean logprob within 1% of the eager run's (perplexity within ~3%).
    Over ~600 tokens the bound was less than two standard errors away (the two runs' per-token
    logprobs differ by ~0.4 nats, std: 0.017 nats against a bound of ~0.03), and int8 weights
    calibrated in another process (a fresh cache) put a run past it; over 2,847 tokens it is 0.006."""
    from radixlm.runtime import Engine

    text = (Path(__file__).parent.parent / "benchmarks" / "data" / "quality_text.txt").read_text()
    params = {"temperature": 0, "max_new_tokens": 1}

    def logprobs(e) -> torch.Tensor:
        e.flush_cache()
        out = e.generate(text, params, return_logprob=True, logprob_start_len=0)
        return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])

    compiled = logprobs(engine)
    with Engine(model=str(smollm_folder), quantization="int8", enable_deterministic_inference=True,
                max_total_tokens=4096, log_level="warning") as e:
        eager = logprobs(e)
    with Engine(model=str(smollm_folder), quantization="none", max_total_tokens=4096, log_level="warning") as e:
        exact = logprobs(e)
    assert len(exact) > 2800
    assert not torch.equal(compiled, eager)  # two forwards, not the eager one twice
    assert (compiled - exact).abs().mean() < 1.1 * (eager - exact).abs().mean()
    assert abs(compiled.mean() / eager.mean() - 1) < 0.01


@needs_int8
@pytest.mark.slow
@pytest.mark.parametrize("options", INVARIANT_OPTIONS, ids=INVARIANT_OPTION_IDS)
def test_compiled_answers_do_not_depend_on_chunks_retraction_or_the_cache(smollm_folder, prompts, alone, options):
    from radixlm.runtime import Engine

    with Engine(model=str(smollm_folder), quantization="int8", enable_torch_compile=True, log_level="warning",
                enable_deterministic_inference=True, **options) as e:
        assert_options_keep_answers(e, options, prompts, GREEDY, alone)
        assert e.runner.compiled.graphs() == 1


def test_a_float32_model_compiled_matches_its_eager_forward(make_tiny_model):
    """A model of another size and dtype in the same process gets its own graph (none of the int8
    model's), whose logits equal the eager forward's within float32 rounding, greedy tokens alike."""
    from radixlm.runtime import Engine

    folder = make_tiny_model()
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    runs = []
    for compile_ in (False, True):
        with Engine(model=str(folder), enable_torch_compile=compile_, max_total_tokens=2048, log_level="warning") as e:
            out = e.generate(prompts, params, return_logprob=True, logprob_start_len=0)
            out += [e.generate(p, params, return_logprob=True, logprob_start_len=0) for p in prompts]  # one row
            runs.append(out)
            if compile_:
                assert e.runner.compiled.graphs() == 1
    assert_same_answers(*runs, tol=1e-4)


def test_compiled_int4_matches_the_eager_forward(make_tiny_model):
    """int4 layers in the compiled graph, on the 4-bit kernel: logprobs equal the eager int4 forward's
    within a rounding (inductor orders a norm's sums its own way), greedy tokens alike. On a CPU with
    bfloat16 dot products, where the layers multiply long steps by their unpacked weights, a step that
    long (the prompts' prefill here) runs the eager forward itself: its logprobs are the eager ones."""
    from radixlm.runtime import Engine
    from radixlm.runtime.executor.cpu import int4

    folder = make_tiny_model(max_position_embeddings=1024)
    long = " ".join(f"item {i}," for i in range(120))  # more tokens than prefill_rows() on any CPU
    prompts = ["The capital of France is", "1, 2, 3, 4,", long]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    runs = []
    for compile_ in (False, True):
        with Engine(model=str(folder), quantization="int4", enable_torch_compile=compile_, max_total_tokens=4096,
                    log_level="warning") as e:
            assert any(isinstance(m, int4.Int4Linear) for m in e.runner.model.modules())
            runs.append(e.generate(prompts, params, return_logprob=True, logprob_start_len=0))
            if compile_:
                assert e.runner.compiled.graphs() == 1
    assert len(runs[0][2]["meta_info"]["input_token_logprobs"]) > int4.prefill_rows()
    assert_same_answers(*runs, tol=1e-3)
    if int4.bf16_matmuls():
        assert [r["meta_info"]["input_token_logprobs"] for r in runs[1]] == \
            [r["meta_info"]["input_token_logprobs"] for r in runs[0]]


def test_a_second_graph_is_refused_not_compiled(make_tiny_model):
    """Inputs the warm-up did not trace for (int32 ids) would need another graph, which could round
    otherwise: the call fails instead, and the model still has its one graph."""
    from radixlm.runtime.executor.model_runner import ModelRunner

    runner = ModelRunner(EngineArgs(model=str(make_tiny_model()), enable_torch_compile=True,
                                    max_total_tokens=256))
    compiled = runner.compiled
    batch = SimpleNamespace(input_ids=torch.zeros(3, dtype=torch.int32), positions=torch.arange(3),
                            logits_indices=torch.tensor([2]))
    with pytest.raises(Exception, match="recompil"):
        runner.compute.run(compiled, batch)
    assert compiled.graphs() == 1


def test_a_graph_that_refuses_a_batch_size_is_a_start_up_error(make_tiny_model, monkeypatch):
    """The warm-up also runs one token, as many logits as tokens and more tokens than it traced with;
    a graph whose guards refuse one of them (as a stride traced for 2+ rows once did) stops the start."""
    from radixlm.runtime.executor import compiled_forward
    from radixlm.runtime.executor.model_runner import ModelRunner

    checked = []
    real = compiled_forward.CompiledForward._check_sizes

    def spy(self, device):
        fn = self._fn

        def refusing_one_token(ids, positions, logits):
            checked.append((len(ids), len(logits)))
            if len(ids) == 1:
                raise RuntimeError("Detected recompile when torch.compile stance is 'fail_on_recompile'")
            return fn(ids, positions, logits)

        self._fn = refusing_one_token
        return real(self, device)

    monkeypatch.setattr(compiled_forward.CompiledForward, "_check_sizes", spy)
    with pytest.raises(RuntimeError, match="does not serve 1 token"):
        ModelRunner(EngineArgs(model=str(make_tiny_model()), enable_torch_compile=True, max_total_tokens=256))
    assert checked == [(1, 1)]


def test_the_ops_run_only_inside_a_compiled_forward():
    from radixlm.runtime.executor import compiled_forward  # noqa: F401  (defines the ops)

    with pytest.raises(RuntimeError, match="only inside a compiled forward"):
        torch.ops.radixlm.int8_matmul(torch.zeros(1, 4), torch.ones(3))


def test_a_model_that_cannot_be_compiled_is_a_start_up_error_naming_the_flag(make_tiny_model, monkeypatch):
    from radixlm.runtime.executor import compiled_forward
    from radixlm.runtime.executor.model_runner import ModelRunner

    def no_compiler(self, device):
        raise OSError("g++: command not found")

    monkeypatch.setattr(compiled_forward.CompiledForward, "warm_up", no_compiler)
    with pytest.raises(RuntimeError, match="--enable-torch-compile.*g\\+\\+: command not found.*without the flag"):
        ModelRunner(EngineArgs(model=str(make_tiny_model()), enable_torch_compile=True, max_total_tokens=256))


def assert_same_answers(eager: list[dict], compiled: list[dict], tol: float) -> None:
    """The same greedy ids, and input and output logprobs within `tol`."""
    for e, c in zip(eager, compiled):
        assert c["output_ids"] == e["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got = torch.tensor([lp for lp, _, _ in c["meta_info"][key] if lp is not None])
            want = torch.tensor([lp for lp, _, _ in e["meta_info"][key] if lp is not None])
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
