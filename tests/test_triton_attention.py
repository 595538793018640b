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
                 shared_len: int = 0, rows: int = 8):
        self.heads, self.kv_heads, self.dim = shape
        self.dtype = dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.pool = KVPool(num_slots, 1, self.kv_heads, self.dim, dtype, DEVICE)
        for t in (self.pool.k[0], self.pool.v[0]):
            t.copy_(torch.randn(t.shape, generator=self.gen))
        self.table = ReqToTokenPool(rows, MAX_CONTEXT + 1, DEVICE)
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


def window_reference(scene: Scene, batch: ForwardBatch, q, k, v, window: int) -> torch.Tensor:
    """Gemma 3's sliding-window attention (models/gemma3.py, which the torch backend's models use past
    a window) on the same inputs in float32."""
    from radixlm.runtime.executor.models.gemma3 import windowed_attention

    pool = batch.kv_pool
    wide = KVPool(pool.num_slots, 1, scene.kv_heads, scene.dim, torch.float32, DEVICE)
    wide.k[0].copy_(pool.k[0])
    wide.v[0].copy_(pool.v[0])
    wide.write(0, batch.out_cache_loc, k.float(), v.float())
    batch.kv_pool = wide
    try:
        return windowed_attention(q.float(), 0, batch, window, scene.dim ** -0.5)
    finally:
        batch.kv_pool = pool


def check(scene: Scene, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == scene.dtype and got.shape == want.shape
    tol = TOLERANCE[scene.dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def run_triton(scene: Scene, batch: ForwardBatch, q, k, v, window: int | None = None) -> torch.Tensor:
    backend = scene.backend()
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, 0, batch, window=window)


@st.composite
def scenes(draw, mode: ForwardMode):
    """A scene and its batch: one example in five has requests of up to 2,048 keys."""
    shape = draw(st.sampled_from(SHAPES))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16]))
    long = draw(st.integers(0, 4)) == 0
    cap = MAX_CONTEXT if long else 96
    shared_len = draw(st.sampled_from([0, 0, 1, 13, 70, 150]))
    everyone = draw(st.booleans())  # all requests share it: a decode takes the cascade pass
    reqs = []
    for _ in range(draw(st.integers(1, 2 if long else 5))):
        new = 1 if mode is ForwardMode.DECODE else draw(st.integers(1, 48))
        length = draw(st.integers(shared_len + new if everyone else 1, max(cap, shared_len + new)))
        new = min(new, length)
        shares = shared_len > 0 and length - new >= shared_len and (everyone or draw(st.booleans()))
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
@given(decode=st.booleans(), case=st.data(), window=st.sampled_from([1, 5, 64, 100]))
def test_sliding_windows_match_gemma3s_reference(decode, case, window):
    """A window (Gemma 3's sliding layers): each query sees itself and the window - 1 keys before it,
    in decode (the cascade's shared pass masking each row's own window) and in extend."""
    scene, reqs = case.draw(scenes(ForwardMode.DECODE if decode else ForwardMode.EXTEND))
    batch, q, k, v = scene.batch(ForwardMode.DECODE if decode else ForwardMode.EXTEND, reqs)
    check(scene, run_triton(scene, batch, q, k, v, window), window_reference(scene, batch, q, k, v, window))


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


@pytest.mark.parametrize("shape,count,split_len", [((9, 3, 64), 30, kernels.SPLIT_LEN), ((8, 2, 128), 3, 16),
                                                   ((4, 4, 64), 2, kernels.SPLIT_LEN)])
def test_cascade_decode_reads_the_shared_prefix_once(shape, count, split_len, monkeypatch):
    """A decode batch sharing a 300-key prefix (one block of query rows or several; 2 or 16 shared
    splits) plans the cascade pass, and its own pass starts after the prefix: with every
    request's table row but the first pointing its prefix at other keys after planning, the output
    still equals the torch backend's on the true keys."""
    monkeypatch.setattr(kernels, "SPLIT_LEN", split_len)
    scene = Scene(shape, torch.float32, 300 + 60 * count + 400, seed=5, shared_len=300, rows=count)
    reqs = [Req(300 + 1 + 7 * (i % 9), 1, shares=True) for i in range(count)]
    batch, q, k, v = scene.batch(ForwardMode.DECODE, reqs)
    assert batch.shared_prefix_len == 300
    want = torch_reference(scene, batch, q, k, v)
    backend = scene.backend()
    backend.init_forward_metadata(batch)
    meta = batch.attn_metadata
    assert meta.shared_splits >= 1 and int(meta.shared_len) == 300
    assert meta.splits == 1  # its own keys: the new token and up to 8 more
    assert meta.shared_splits == min(kernels.MAX_SPLITS, -(-300 // split_len))
    others = batch.req_rows[1:]
    batch.req_to_token[others, :300] = scene.free[:300]  # slots nobody wrote: another prefix
    check(scene, backend.forward(q, k, v, 0, batch), want)


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
    key) runs without harm, behind a shared prefix too."""
    scene = Scene((8, 2, 128), torch.float32, 4000, seed=3, shared_len=300)
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
        assert torch.equal(replayed, plain), (replayed - plain).abs().max()
        check(scene, replayed, torch_reference(scene, batch, q, k, v))
    # a shared prefix: the same graph buffers, the cascade's length rewritten in place (then back to none)
    shared_scene_reqs = [Req(400, 1, shares=True), Req(350, 1, shares=True), Req(302, 1, shares=True)]
    for reqs in (shared_scene_reqs, [Req(20, 1), Req(7, 1)]):
        batch, q, k, v = scene.batch(ForwardMode.DECODE, reqs)
        backend.init_forward_metadata_replay(batch)
        meta = batch.attn_metadata
        assert meta.shared_len.data_ptr() == static.shared_len.data_ptr()
        assert int(meta.shared_len) == batch.shared_prefix_len == (300 if reqs is shared_scene_reqs else 0)
        assert meta.shared_splits == static.shared_splits > 0
        check(scene, backend.forward(q, k, v, 0, batch), torch_reference(scene, batch, q, k, v))
    other = Scene((8, 2, 128), torch.float32, 64, seed=4)
    moved, *_ = other.batch(ForwardMode.DECODE, [Req(3, 1)])
    with pytest.raises(RuntimeError, match="table moved"):
        backend.init_forward_metadata_replay(moved)


@settings(SETTINGS, max_examples=examples(8))
@given(case=scenes(ForwardMode.DECODE), split_len=st.sampled_from([kernels.SPLIT_LEN, 16]),
       window=st.sampled_from([0, 0, 5, 100]), spare=st.integers(0, 9))
def test_a_graph_replay_gives_the_eager_decodes_bits(case, split_len, window, spare):
    """A replay plans for the longest context (its grid and partial buffers, the cascade pass always
    in it), eager decode for this batch's lengths; each row's splits and their merge follow its own
    keys, so both give the same bits (a CUDA graph must never change a sampled token)."""
    scene, reqs = case
    batch, q, k, v = scene.batch(ForwardMode.DECODE, reqs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "SPLIT_LEN", split_len)
        eager = run_triton(scene, batch, q, k, v, window)
        graphed = scene.backend()
        graphed.init_graph_state(max_bs=len(reqs) + spare, max_context=MAX_CONTEXT, device=DEVICE)
        graphed.init_forward_metadata_replay(batch)
        assert batch.attn_metadata.splits == kernels.num_splits(MAX_CONTEXT)
        replayed = graphed.forward(q, k, v, 0, batch, window=window)
    assert torch.equal(replayed, eager), (replayed.float() - eager.float()).abs().max()


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
    backends, requests decoding behind a shared cached prefix (the cascade pass) included, and with
    decode through the graph runner's eager twin (the hooks as graphs use them); short splits make
    decode split its keys."""
    from radixlm.runtime import Engine
    from radixlm.runtime.executor.cuda_graph import EAGER_ENV

    monkeypatch.setattr(kernels, "SPLIT_LEN", 16)
    cascades = []
    plain_decode = kernels.decode
    monkeypatch.setattr(kernels, "decode", lambda *a: (cascades.append(a[9]), plain_decode(*a)))
    folder = make_tiny_model("LlamaForCausalLM", seed=7, hidden_size=192, num_attention_heads=3,
                             num_key_value_heads=1, intermediate_size=256)
    prefix = list(range(100, 170))  # past CASCADE_MIN_SHARED
    prompts = [prefix + [7, 8, 9], prefix + [11, 12], prefix + [13], [42]]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = []
    for name, graphs in (("torch", False), ("triton", False), ("triton", True)):
        monkeypatch.setenv(EAGER_ENV, "1" if graphs else "0")
        cascades.clear()
        # a short context: the graph twin plans every bucket's splits for it; float32 on CUDA too, so
        # the backends' different bfloat16 rounding cannot flip a random model's near-tied argmax
        with Engine(model=str(folder), attention_backend=name, max_total_tokens=1024, max_running_requests=4,
                    context_length=96, device=DEVICE.type, dtype="float32", log_level="warning") as engine:
            assert engine.runner.attn_backend.name == name
            assert engine.runner.model.fused_ops == (name == "triton")  # models/triton_layer_ops.py
            first = engine.generate(input_ids=prompts[:1], sampling_params=params)  # caches the prefix
            shared = engine.generate(input_ids=prompts[1:3], sampling_params=params)  # decode behind it
            alone = engine.generate(input_ids=prompts[3:], sampling_params=params)
            assert isinstance(first, list) and isinstance(shared, list) and isinstance(alone, list)
            outputs.append([o["output_ids"] for o in first + shared + alone])
            runner = engine.runner.graph_runner
            recorded = DEVICE.type == "cuda" and engine.runner.attn_backend.graph_exact  # triton's, not torch's
            assert (runner is not None and runner.replays > 0) == (graphs or recorded)
        assert (name == "torch") == (not cascades) and (name == "torch" or max(cascades) > 0)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


def test_gemma3_sliding_layers_on_triton_give_the_torch_backends_tokens(make_tiny_model, monkeypatch):
    """A tiny Gemma 3 (windows of 12 keys, shorter than every prompt) on the Triton backend, which
    applies the windows itself (so its decode runs in graphs: here the graph runner's eager twin),
    gives the torch backend's greedy tokens, which apply them in models/gemma3.py: prompts behind a
    shared cached prefix (the cascade's shared pass masks each row's window) and one alone."""
    from radixlm.runtime import Engine
    from radixlm.runtime.executor.cuda_graph import EAGER_ENV

    folder = make_tiny_model("Gemma3ForCausalLM", seed=3, initializer_range=0.2, head_dim=32, sliding_window=12,
                             query_pre_attn_scalar=24, num_hidden_layers=3, final_logit_softcapping=30.0,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    prefix = list(range(200, 270))
    prompts = [prefix + [7, 8, 9], prefix + [11, 12], prefix + [13], list(range(300, 330))]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    outputs = []
    for name, graphs in (("torch", False), ("triton", False), ("triton", True)):
        monkeypatch.setenv(EAGER_ENV, "1" if graphs else "0")
        with Engine(model=str(folder), attention_backend=name, max_total_tokens=1024, max_running_requests=4,
                    context_length=96, device=DEVICE.type, dtype="float32", log_level="warning") as engine:
            assert engine.runner.model.graph_safe == (name == "triton")
            first = engine.generate(input_ids=prompts[:1], sampling_params=params)
            shared = engine.generate(input_ids=prompts[1:3], sampling_params=params)
            alone = engine.generate(input_ids=prompts[3:], sampling_params=params)
            outputs.append([o["output_ids"] for o in first + shared + alone])
            runner = engine.runner.graph_runner
            assert (runner is not None and runner.replays > 0) == (graphs or DEVICE.type == "cuda" and name == "triton")
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
