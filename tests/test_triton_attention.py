"""The triton attention backend against the torch backend, on the CPU under triton's interpreter.

Without a GPU, `TRITON_INTERPRET=1` (set here before triton is imported) runs the kernels on CPU
tensors; with one, the same tests run them natively on CUDA tensors. Batches are drawn by
hypothesis: batch sizes, ragged lengths up to 2,048 keys, slots scattered over the pool, prefixes
shared through the same slots, GQA ratios (the built-in model's 9 heads over 3 KV heads among them),
head dims 64, 96 and 128, float32 / bfloat16 / float16. The interpreter is slow, so long sequences
come in few examples.

Tolerances: float32 within 1e-5 of the torch backend. In bfloat16 and float16 the reference is the
torch backend on the same (rounded) inputs in float32, and the kernels must be within the rounding
of their own output and of the probabilities they cast to the value dtype: 1e-2 for bfloat16
(8 mantissa bits), 2e-3 for float16 (11).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
pytest.importorskip("triton", reason="the triton backend needs the triton package (the dev extra has it)")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis_budget import examples

from radixlm.runtime.executor.attention import create_attention_backend  # noqa: E402
from radixlm.runtime.executor.attention import triton_kernels as kernels  # noqa: E402
from radixlm.runtime.executor.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardBatch, ForwardMode  # noqa: E402
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_CONTEXT = 2048
# (heads, KV heads, head dim): MHA, GQA 2/4/8, the built-in model's 9/3 at 64, a dim that is no power of 2
SHAPES = [(4, 4, 64), (8, 4, 64), (8, 2, 128), (8, 1, 64), (9, 3, 64), (16, 2, 128), (4, 2, 96)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass
class Req:
    length: int  # all its keys, the new tokens included
    new: int  # new tokens this step
    shares: bool = False  # its prefix starts with the scene's shared slots


class Scene:
    """A KV pool with random K/V in scattered slots and a req->token table, for several batches."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, num_slots: int, seed: int,
                 shared_len: int = 0):
        self.heads, self.kv_heads, self.dim = shape
        self.dtype = dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = KVPool(num_slots, 1, self.kv_heads, self.dim, dtype, DEVICE)
        for t in (self.pool.k[0], self.pool.v[0]):
            t.copy_(torch.randn(t.shape, generator=self.gen))
        self.table = ReqToTokenPool(8, MAX_CONTEXT + 1, DEVICE)
        self.free = torch.randperm(num_slots, generator=self.gen)
        self.shared = self._take(shared_len)

    def _take(self, n: int) -> torch.Tensor:
        out, self.free = self.free[:n], self.free[n:]
        return out

    def batch(self, mode: ForwardMode, reqs: list[Req]):
        """The batch of the requests' new tokens, and their q/k/v."""
        rows, prefix, new, slots = [], [], [], []
        for r in reqs:
            row = self.table.alloc()
            head = self.shared if r.shares else self._take(0)
            cached = torch.cat([head, self._take(r.length - r.new - head.numel())])
            fresh = self._take(r.new)
            self.table.write(row, 0, torch.cat([cached, fresh]))
            rows.append(row)
            prefix.append(cached.numel())
            new.append(r.new)
            slots.append(fresh)
        t = sum(new)
        plan = BatchPlan(mode, [0] * t, torch.cat(slots), rows, prefix, new, list(range(t)))
        batch = ForwardBatch.build(plan, self.table, self.pool, DEVICE)
        for row in rows:
            self.table.free(row)
        q, k, v = (torch.randn(t, h, self.dim, generator=self.gen).to(DEVICE, self.dtype)
                   for h in (self.heads, self.kv_heads, self.kv_heads))
        return batch, q, k, v

    def backend(self):
        return create_attention_backend("triton", num_heads=self.heads, num_kv_heads=self.kv_heads,
                                        head_dim=self.dim, device=DEVICE)


def torch_reference(scene: Scene, batch: ForwardBatch, q, k, v) -> torch.Tensor:
    """The torch backend on the same inputs in float32 (in place of the batch's pool, restored)."""
    pool = batch.kv_pool
    wide = KVPool(pool.num_slots, 1, scene.kv_heads, scene.dim, torch.float32, DEVICE)
    wide.k[0].copy_(pool.k[0])
    wide.v[0].copy_(pool.v[0])
    batch.kv_pool = wide
    try:
        backend = TorchAttentionBackend(scene.heads, scene.kv_heads, scene.dim)
        backend.init_forward_metadata(batch)
        return backend.forward(q.float(), k.float(), v.float(), 0, batch)
    finally:
        batch.kv_pool = pool


def check(scene: Scene, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == scene.dtype and got.shape == want.shape
    tol = TOLERANCE[scene.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def run_triton(scene: Scene, batch: ForwardBatch, q, k, v) -> torch.Tensor:
    backend = scene.backend()
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, 0, batch)


@st.composite
def scenes(draw, mode: ForwardMode):
    """A scene and its batch: one example in five has requests of up to 2,048 keys."""
    shape = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]))
    long = draw(st.integers(0, 4)) == 0
    cap = MAX_CONTEXT if long else 96
    shared_len = draw(st.sampled_from([0, 0, 1, 13, 70]))
    reqs = []
    for _ in range(draw(st.integers(1, 2 if long else 5))):
        length = draw(st.integers(1, cap))
        new = 1 if mode is ForwardMode.DECODE else draw(st.integers(1, min(length, 48)))
        shares = shared_len > 0 and length - new >= shared_len and draw(st.booleans())
        reqs.append(Req(length, new, shares))
    slots = shared_len + sum(r.length for r in reqs) + 16  # a few slots nobody reads
    scene = Scene(shape, dtype, slots, draw(st.integers(0, 2**16)), shared_len)
    return scene, reqs


# no shrinking: under the interpreter it reruns a failing case for minutes; the failure is shown as drawn
SETTINGS = settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


@SETTINGS
@given(case=scenes(ForwardMode.DECODE), split_len=st.sampled_from([kernels.SPLIT_LEN, 16]))
def test_decode_matches_the_torch_backend(case, split_len):
    """Paged decode, with one split or several (short splits make short requests split too)."""
    scene, reqs = case
    batch, q, k, v = scene.batch(ForwardMode.DECODE, reqs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "SPLIT_LEN", split_len)
        got = run_triton(scene, batch, q, k, v)
    check(scene, got, torch_reference(scene, batch, q, k, v))


@SETTINGS
@given(case=scenes(ForwardMode.EXTEND))
def test_extend_matches_the_torch_backend(case):
    """Extend over cached prefixes (none, private, shared) with causal new tokens; 1-token rows
    ride along as in mixed batches."""
    scene, reqs = case
    batch, q, k, v = scene.batch(ForwardMode.EXTEND, reqs)
    check(scene, run_triton(scene, batch, q, k, v), torch_reference(scene, batch, q, k, v))


@pytest.mark.parametrize("shape", [(9, 3, 64), (16, 2, 128)])
def test_long_decode_takes_split_kv_and_short_does_not(shape):
    scene = Scene(shape, torch.float32, 3200, seed=1)
    backend = scene.backend()
    long_batch, q, k, v = scene.batch(ForwardMode.DECODE, [Req(2048, 1), Req(700, 1), Req(3, 1)])
    backend.init_forward_metadata(long_batch)
    assert long_batch.attn_metadata.splits > 1
    check(scene, backend.forward(q, k, v, 0, long_batch), torch_reference(scene, long_batch, q, k, v))
    short_batch, q, k, v = scene.batch(ForwardMode.DECODE, [Req(200, 1), Req(1, 1)])
    backend.init_forward_metadata(short_batch)
    assert short_batch.attn_metadata.splits == 1
    check(scene, backend.forward(q, k, v, 0, short_batch), torch_reference(scene, short_batch, q, k, v))


def test_extend_with_and_without_prefix_in_one_batch():
    """A prompt, a chunk after a long cached prefix, a prefix shorter than its chunk, and 1-token rows,
    with the heads of a group spread over several query blocks."""
    scene = Scene((9, 3, 64), torch.float32, 2400, seed=2)
    reqs = [Req(150, 150), Req(1900, 40), Req(90, 70), Req(33, 1), Req(1, 1)]
    batch, q, k, v = scene.batch(ForwardMode.EXTEND, reqs)
    check(scene, run_triton(scene, batch, q, k, v), torch_reference(scene, batch, q, k, v))


def test_graph_hooks_replay_smaller_batches_in_place():
    """Capture at the largest bucket; replays of smaller batches rewrite the same buffers (the
    split count fixed by the length bound) and give the plain path's output. A padding row (one
    key) runs without harm."""
    scene = Scene((8, 2, 128), torch.float32, 4000, seed=3)
    backend = scene.backend()
    assert backend.supports_graphs
    backend.init_graph_state(max_bs=4, max_context=MAX_CONTEXT, device=DEVICE)
    first, *_ = scene.batch(ForwardMode.DECODE, [Req(5, 1), Req(40, 1), Req(9, 1), Req(2, 1)])
    backend.init_forward_metadata_capture(first)
    static = first.attn_metadata
    assert static.splits > 1  # planned for MAX_CONTEXT keys, whatever this batch's lengths
    for reqs in ([Req(1500, 1), Req(1, 1)], [Req(300, 1), Req(64, 1), Req(1, 1)]):
        batch, q, k, v = scene.batch(ForwardMode.DECODE, reqs)
        backend.init_forward_metadata_replay(batch)
        meta = batch.attn_metadata
        for name in ("rows", "seq_lens", "mid_o", "mid_lse"):
            assert getattr(meta, name).data_ptr() == getattr(static, name).data_ptr(), name
        assert meta.splits == static.splits
        replayed = backend.forward(q, k, v, 0, batch)
        plain = run_triton(scene, batch, q, k, v)
        torch.testing.assert_close(replayed, plain, atol=1e-6, rtol=1e-6)
        check(scene, replayed, torch_reference(scene, batch, q, k, v))
    other = Scene((8, 2, 128), torch.float32, 64, seed=4)
    moved, *_ = other.batch(ForwardMode.DECODE, [Req(3, 1)])
    with pytest.raises(RuntimeError, match="table moved"):
        backend.init_forward_metadata_replay(moved)


def test_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)
    with pytest.raises(RuntimeError, match="needs CUDA, or TRITON_INTERPRET=1"):
        create_attention_backend("triton", num_heads=4, num_kv_heads=2, head_dim=64, device="cpu")


def test_runtime_imports_never_load_triton():
    code = ("import sys; from radixlm.runtime import Engine; import radixlm.runtime.executor.model_runner; "
            "from radixlm.runtime.executor.attention import create_attention_backend; "
            "create_attention_backend('torch', num_heads=4, num_kv_heads=2, head_dim=8); "
            "assert 'triton' not in sys.modules, 'triton was imported'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_engine_on_triton_gives_the_torch_backend_tokens(make_tiny_model, monkeypatch):
    """Greedy tokens of a tiny GQA model (3 heads over 1 KV head, head dim 64) are the same on both
    backends, prompts sharing a cached prefix included, and with decode through the graph runner's
    eager twin (the hooks as graphs use them); short splits make decode split its keys."""
    from radixlm.runtime import Engine
    from radixlm.runtime.executor.cuda_graph import EAGER_ENV

    monkeypatch.setattr(kernels, "SPLIT_LEN", 16)
    folder = make_tiny_model("LlamaForCausalLM", seed=7, hidden_size=192, num_attention_heads=3,
                             num_key_value_heads=1, intermediate_size=256)
    prefix = list(range(100, 130))
    prompts = [prefix + [7, 8, 9], prefix + [11, 12], [42]]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = []
    for name, graphs in (("torch", False), ("triton", False), ("triton", True)):
        monkeypatch.setenv(EAGER_ENV, "1" if graphs else "0")
        # a short context: the graph twin plans every bucket's splits for it; float32 on CUDA too, so
        # the backends' different bfloat16 rounding cannot flip a random model's near-tied argmax
        with Engine(model=str(folder), attention_backend=name, max_total_tokens=1024, max_running_requests=4,
                    context_length=48, device=DEVICE.type, dtype="float32", log_level="warning") as engine:
            assert engine.runner.attn_backend.name == name
            first = engine.generate(input_ids=prompts[:1], sampling_params=params)  # caches the prefix
            rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
            assert isinstance(first, list) and isinstance(rest, list)
            outputs.append([o["output_ids"] for o in first + rest])
            runner = engine.runner.graph_runner
            recorded = DEVICE.type == "cuda" and engine.runner.attn_backend.graph_exact  # triton's, not torch's
            assert (runner is not None and runner.replays > 0) == (graphs or recorded)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
