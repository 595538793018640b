"""CPU kernels: the matmul choice (models/linear.py: oneDNN on CPU float32, torch elsewhere) and the
allocator setting of the model runner. (The blocked attention kernel in whole models: test_models.py.)"""

from __future__ import annotations

import resource
import sys

import pytest
import torch
import torch.nn.functional as F

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.executor.models import linear as lin

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(lin.onednn_usable(CPU, torch.float32) is not None,
                                  reason="this torch build has no usable oneDNN matmul")


def test_choice_rules():
    assert lin.choose_gemm("torch", CPU, torch.float32) == "torch"
    assert lin.choose_gemm("auto", CPU, torch.bfloat16) == "torch"  # torch already uses oneDNN for bf16
    assert lin.choose_gemm("auto", torch.device("meta"), torch.float32) == "torch"
    with pytest.raises(ValueError, match="only float32 on the CPU"):
        lin.choose_gemm("onednn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        EngineArgs(cpu_gemm="fast")


def test_kernel_choices_are_automatic_and_forced_only_for_debugging(monkeypatch, caplog):
    """The float32 CPU kernel and int8's second packing are the runtime's own choices: an environment
    variable forces one; the old flags still do, with one deprecation warning each."""
    import logging

    from radixlm.runtime import engine_args

    assert EngineArgs().forced_kernel("cpu_gemm") == "auto"
    monkeypatch.setenv("RADIXLM_CPU_GEMM", "torch")
    assert EngineArgs().forced_kernel("cpu_gemm") == "torch"
    monkeypatch.setenv("RADIXLM_INT8_BATCH_PACKING", "sometimes")
    with pytest.raises(ValueError, match="RADIXLM_INT8_BATCH_PACKING must be one of"):
        EngineArgs().forced_kernel("int8_batch_packing")
    monkeypatch.delenv("RADIXLM_CPU_GEMM")
    engine_args._deprecated_flag.cache_clear()
    with caplog.at_level(logging.WARNING, logger="radixlm.runtime.engine_args"):
        assert [EngineArgs(cpu_gemm="onednn").forced_kernel("cpu_gemm") for _ in range(3)] == ["onednn"] * 3
    assert [r.getMessage() for r in caplog.records].count(
        "--cpu-gemm is deprecated: the kernel is chosen automatically, and RADIXLM_CPU_GEMM forces one for "
        "debugging") == 1


@needs_onednn
def test_auto_prefers_onednn_and_falls_back_when_it_is_broken(monkeypatch):
    assert lin.choose_gemm("auto", CPU, torch.float32) == "onednn"

    def wrong(x, w, b):
        return F.linear(x, w, b) + 1.0

    monkeypatch.setattr(lin, "onednn_linear", wrong)
    assert lin.choose_gemm("auto", CPU, torch.float32) == "torch"
    with pytest.raises(ValueError, match="disagrees"):
        lin.choose_gemm("onednn", CPU, torch.float32)

    def broken(x, w, b):
        raise RuntimeError("no primitive")

    monkeypatch.setattr(lin, "onednn_linear", broken)
    assert lin.choose_gemm("auto", CPU, torch.float32) == "torch"


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96), (300, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_is_float32_exact_to_rounding(shape, bias):
    """Against a float64 reference the oneDNN product is as accurate as F.linear (no silent bf16/tf32)."""
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[0])
    layer = lin.Linear(96, 200, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(*shape, generator=gen)
    ref = F.linear(x.double(), layer.weight.double(), layer.bias.double() if bias else None)
    with torch.inference_mode():
        plain = layer(x)
        layer.onednn = True
        fast = layer(x)
        strided = layer(torch.randn(96, *shape[:-1][::-1], generator=gen).transpose(0, -1))  # non-contiguous input
    assert fast.shape == plain.shape == ref.shape and fast.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (fast.double() - ref).abs().max().item() <= 1e-5 * scale
    assert (plain.double() - ref).abs().max().item() <= 1e-5 * scale
    assert strided.shape[-1] == 200 and torch.isfinite(strided).all()


@needs_onednn
def test_models_on_both_kernels_give_the_same_greedy_tokens(make_tiny_model):
    """The same tiny model on oneDNN and on torch's kernel: logits within float32 noise of each other
    and of transformers (test_models checks the default choice against transformers in detail)."""
    from test_models import PROMPTS, hf_logits, our_logits
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model("LlamaForCausalLM", seed=5)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {}
    for gemm in ("onednn", "torch"):
        runner = ModelRunner(EngineArgs(model=str(folder), quantization="none",
                                        max_total_tokens=512, max_running_requests=4,
                                        cpu_gemm=gemm))
        assert runner.gemm == gemm
        assert all(m.onednn == (gemm == "onednn") for m in runner.model.modules() if isinstance(m, lin.Linear))
        out[gemm] = our_logits(runner, PROMPTS)
    for p, a, b in zip(PROMPTS, out["onednn"], out["torch"]):
        want = hf_logits(ref, p)
        torch.testing.assert_close(a, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_activations_are_reused_without_page_faults():
    """After keep_freed_memory (the model runner calls it on CPU), a fresh 4 MiB tensor per op reuses
    freed memory instead of faulting in new pages (glibc's default mmaps and unmaps such blocks)."""
    from radixlm.runtime.executor.model_runner import keep_freed_memory

    assert keep_freed_memory()

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    torch.empty(2**20).fill_(1.0)  # warm the heap once
    before = faults()
    for _ in range(20):
        torch.empty(2**20).fill_(1.0)
    pages_per_tensor = 2**22 // resource.getpagesize()
    assert faults() - before < 2 * pages_per_tensor  # 20 fresh mmaps would fault 20x
