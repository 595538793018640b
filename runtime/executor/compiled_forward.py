"""The model's forward compiled by torch.compile on the CPU (`--enable-torch-compile`, SGLang's flag).

A one-client int8 decode step of SmolLM2-135M is 121 matmuls and about 2,000 small ops (norms, row
quantization, scales, RoPE, residual adds), and each small op costs microseconds of dispatch and
Python: together more than the matmuls. Inductor fuses the ops between two matmuls into one or two
C++ loops, so the step runs the library's matmul kernels, the attention backend and a few generated
loops (`benchmarks/README.md`, "CPU weight formats").

What the compiler sees: the whole model, with the matmuls it cannot trace and the attention each
behind an op of the `radixlm` library whose Python body does what the eager forward does:
- `radixlm::int8_matmul`: the packed int8 weights are TorchBind objects that cannot be traced; the
  op finds the layer by its weight scales (a tensor the graph passes) and runs its library kernel;
- `radixlm::packed_linear`: the same for fp16 weights (fbgemm's packing), found by a tag tensor;
- int4 layers need no op of ours: their packed weights are plain tensors, and the graph calls the
  4-bit kernel itself (long steps run eagerly where the layers switch kernels, see below);
- `radixlm::linear`: float matmuls on the kernel the model chose (oneDNN's op, which inductor's own
  fusion passes would rewrite);
- `radixlm::attention`: the backend plans once per step and keeps state across steps (what decodes
  keep of their gathers), so it runs as it does in eager mode, on the step's batch.
The step (this forward and its batch) reaches the ops through a thread-local set around each call.
Each decoder layer is a `nested_compile_region`, traced once for all layers (the layer's number is a
tensor too), which keeps the compile to seconds.

One graph for every batch: the token and logits counts are traced as sizes of their own, with no
graph for one row (`backed_size_oblivious`, no duck sizing), and after the warm-up any recompile is
an error (`fail_on_recompile`) instead of a second graph that might fuse and round otherwise; the
warm-up runs the sizes a guard could refuse (`CHECKED_SIZES`), so such a guard stops the start. Every
forward of the model, prefill or decode, alone or batched, runs that one graph, whose loops treat
every row alike, so a row's logits and its K/V never depend on the rest of the batch: the int8
invariance tests run on it (tests/test_torch_compile.py). Its answers are not the eager forward's to
the bit (inductor orders a norm's sums its own way), so a server runs one or the other throughout,
with one exception: where int4 layers multiply long steps by their unpacked weights instead of the
4-bit kernel (`unpack_from` rows, on a CPU with bfloat16 dot products), steps that long run the eager
forward. The graph would need a second copy for them (a guard on the step's rows, or a `torch.cond`,
which inductor does not cache), seconds more at every start, for steps whose small ops are a few
percent of their time; and a row's int4 answer depends on its step's size anyway, through that
switch (enable_deterministic_inference refuses int4).

Inductor's compiled code is cached under `<cache>/inductor` (RADIXLM_CACHE_DIR, beside the model
conversions): the first start compiles for tens of seconds, later ones trace and load in seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.executor.attention.base import AttentionBackend
from radixlm.runtime.executor.cpu.fp16 import fp16_packs
from radixlm.runtime.executor.cpu.int4 import Int4Linear
from radixlm.runtime.executor.cpu.int8 import Int8Linear
from radixlm.runtime.executor.forward_batch import ForwardBatch
from radixlm.runtime.executor.models.linear import linear

logger = logging.getLogger(__name__)

WARMUP_TOKENS = 16  # the warm-up's token count: the size hint inductor plans its loops with
WARMUP_LOGITS = 2  # differs from WARMUP_TOKENS, so that no relation between the two is traced
CHECKED_SIZES = ((1, 1), (3, 3), (WARMUP_TOKENS + 37, 1))  # (tokens, logits) the one graph must also serve
# Inductor checks the size and strides of every input and every op's output of the graph as it runs it:
# ~480 checks a decode step, a few percent of a compiled one-client int8 step. They guard against an op whose
# output differs from what was traced, which the test suite would catch (it sets this variable to 1).
SIZE_ASSERTS_ENV = "RADIXLM_DEBUG_COMPILE"


class _Step(threading.local):
    """The forward running on this thread, and its batch (None while the graph is compiled)."""

    forward: CompiledForward | None = None
    batch: ForwardBatch | None = None


_STEP = _Step()

_LIB = torch.library.Library("radixlm", "DEF")
_LIB.define("int8_matmul(Tensor xq, Tensor weight_scale) -> Tensor")
_LIB.define("packed_linear(Tensor x, Tensor tag) -> Tensor")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, Tensor layer) -> Tensor")
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias, bool onednn, int min_rows) -> Tensor")


def _packed_product(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """int8_matmul and packed_linear: the product of the layer that owns `key` ([out] per layer)."""
    return _running().products[key.data_ptr()](x)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    forward = _running()
    if _STEP.batch is None:  # the warm-up compiles the graph: no KV slot is written
        return q.new_zeros(q.shape)
    return forward.backend.forward(q, k, v, forward.layers[layer.data_ptr()], _STEP.batch)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
            min_rows: int) -> torch.Tensor:
    return linear(x, weight, bias, onednn, min_rows)


def _running() -> CompiledForward:
    forward = _STEP.forward
    if forward is None:
        raise RuntimeError("radixlm ops run only inside a compiled forward (executor/compiled_forward.py)")
    return forward


_LIB.impl("int8_matmul", _packed_product, "CPU")
_LIB.impl("packed_linear", _packed_product, "CPU")
_LIB.impl("attention", _attention, "CPU")
_LIB.impl("linear", _linear, "CPU")


def _packed_product_fake(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], key.shape[0])


torch.library.register_fake("radixlm::int8_matmul", _packed_product_fake, lib=_LIB)
torch.library.register_fake("radixlm::packed_linear", _packed_product_fake, lib=_LIB)


@torch.library.register_fake("radixlm::attention", lib=_LIB)
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape)


@torch.library.register_fake("radixlm::linear", lib=_LIB)
def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool,
                 min_rows: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def _stepping(forward: CompiledForward, batch: ForwardBatch | None):
    saved = _STEP.forward, _STEP.batch
    _STEP.forward, _STEP.batch = forward, batch
    try:
        yield
    finally:
        _STEP.forward, _STEP.batch = saved


def _own_copy(method: Callable) -> Callable:
    """`method` bound to a copy of its code: dynamo keeps its compiled graphs per code object."""
    fn = method.__func__
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(fresh, method.__self__)


def _guards_kept(entries) -> list[bool]:
    """The graph's guards, less two kinds. Those on the model's modules and tensors: checking them costs
    every step, and the run is this model's own copy of the code, so no other model's call can find
    its graph. And the global-state guard, whose part that can change here is torch's thread count: the
    thread governor (cpu/contention.py) resizes the team under load, and the graph must go on serving,
    on the new team (its generated loops ask OpenMP for the team's size, `cpp.dynamic_threads`). Grad
    mode and deterministic algorithms keep guards of their own."""
    modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    return [keep and entry.guard_type != "GLOBAL_STATE" for keep, entry in zip(modules, entries)]


def use_cache_dir(cache: Path) -> None:
    """Inductor's compiled code goes to `<cache>/inductor` unless TORCHINDUCTOR_CACHE_DIR says otherwise
    (inductor reads the variable whenever it looks for its cache)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))


class CompiledForward:
    """`model.run` compiled once (`warm_up`), then called for every step in place of `model(batch)`."""

    def __init__(self, model: nn.Module, backend: AttentionBackend):
        self.model = model
        self.backend = backend
        # the traced graph passes each int8 layer's weight scales and each attention layer's tag; the ops
        # find the layer by them (a dict lookup, not a tensor read on the decode path)
        self.products = {m.weight_scale.data_ptr(): m.product for m in model.modules() if isinstance(m, Int8Linear)}
        self.products.update(fp16_packs(model))  # fp16 layers: found by their tag (cpu/fp16.py)
        self.layers = {m.layer_tag.data_ptr(): m.layer_id for m in model.modules() if hasattr(m, "layer_tag")}
        # int4 layers switch to their unpacked weights from this many rows: steps that long run eagerly
        self.unpack_from = min((m.unpack_from for m in model.modules()
                                if isinstance(m, Int4Linear) and m.unpack_from is not None), default=None)
        self._fn = torch.compile(_own_copy(model.run), fullgraph=True,
                                 options={"guard_filter_fn": _guards_kept, "cpp.dynamic_threads": True,
                                          "size_asserts": os.environ.get(SIZE_ASSERTS_ENV) == "1"})

    def warm_up(self, device: torch.device) -> float:
        """Compiles the graph on a dummy step (the attention op writes nothing then); seconds taken."""
        start = time.perf_counter()
        inputs = _dummy_inputs(WARMUP_TOKENS, WARMUP_LOGITS, device)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 0)
        sizes = torch.fx.experimental._config
        # floats (a norm's eps) are constants of the graph, not inputs a layer's region cannot take
        with sizes.patch(backed_size_oblivious=True, use_duck_shape=False), \
                torch._dynamo.config.patch(specialize_float=True), _stepping(self, None), torch.inference_mode():
            self._fn(*inputs)
        self._check_sizes(device)
        return time.perf_counter() - start

    def _check_sizes(self, device: torch.device) -> None:
        """The graph serves one token, as many logits as tokens and more tokens than the warm-up's; a
        guard that refuses one of them (a stride traced for 2+ rows, say) is found here, at start-up."""
        for tokens, logits in CHECKED_SIZES:
            try:
                self._run(None, *_dummy_inputs(tokens, logits, device))
            except RuntimeError as e:
                raise RuntimeError(f"the compiled forward does not serve {tokens} token(s) with {logits} logit row(s) "
                                   f"in its one graph: {str(e).strip()[:500]}") from e

    def graphs(self) -> int:
        """Graphs compiled for this model so far: 1 once warmed up, and it stays 1."""
        code = self._fn._torchdynamo_orig_callable.__func__.__code__
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if self.unpack_from is not None and batch.input_ids.shape[0] >= self.unpack_from:
            return self.model(batch)  # the eager forward (see the module docstring)
        return self._run(batch, batch.input_ids, batch.positions, batch.logits_indices)

    def _run(self, batch: ForwardBatch | None, ids: torch.Tensor, positions: torch.Tensor,
             logits: torch.Tensor) -> torch.Tensor:
        with _stepping(self, batch), torch.compiler.set_stance("fail_on_recompile"), torch.inference_mode():
            return self._fn(ids, positions, logits)


def _dummy_inputs(tokens: int, logits: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(ids, positions, logits indices) of a dummy step, made outside inference mode as the scheduler
    makes a batch's tensors (the graph guards on that)."""
    return (torch.zeros(tokens, dtype=torch.long, device=device), torch.arange(tokens, device=device),
            torch.arange(logits, device=device))
