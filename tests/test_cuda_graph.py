"""The CUDA-graph runner (executor/cuda_graph.py) on the CPU, with recording replaced by eager runs:
for every bucket and a batch size just above each bucket's predecessor, its logits and greedy tokens
equal the plain forward's; replays rewrite the static buffers in place; padding rows write only the
pool's dummy slot, which (like the dummy req->token row) is never handed out; an Engine running its
decode through the runner answers exactly as one without it, with overlap on and off. Tests marked
`cuda` record real graphs on a GPU."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch
from batch_utils import ManualBatches

from radixlm.runtime import Engine
from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.cuda_graph import EAGER_ENV, CudaGraphRunner, graph_buckets
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardMode
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from radixlm.runtime.executor.model_runner import ModelRunner

MAX_BS = 20
BUCKETS = graph_buckets(MAX_BS)
SIZES = sorted(set(BUCKETS) | {b + 1 for b in BUCKETS[:-1]})  # each bucket, and one past its predecessor


@pytest.fixture(scope="module")
def tiny(make_tiny_model) -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def setup(tiny):
    """A CPU ModelRunner (plain forward: the runner is off on the CPU by default), an eager runner
    over its model and pools, and MAX_BS prefilled sequences of different lengths, half of them
    sharing the first 9 tokens of sequence 0."""
    runner = ModelRunner(EngineArgs(model=str(tiny), max_total_tokens=2048, max_running_requests=MAX_BS,
                                    context_length=256))
    assert runner.graph_runner is None
    graphs = CudaGraphRunner(runner.model, runner.attn_backend, runner.kv_pool, runner.req_to_token, MAX_BS,
                             runner.device, record=False)
    gen = torch.Generator().manual_seed(0)
    mb = ManualBatches(runner)
    mb.forward(ForwardMode.EXTEND, [(mb.new_seq(), _tokens(12, gen))])
    items = []
    for i in range(1, MAX_BS):
        seq = mb.new_seq(shared_from=0, shared_len=9) if i % 2 else mb.new_seq()
        items.append((seq, _tokens(1 + (7 * i) % 13, gen)))
    mb.forward(ForwardMode.EXTEND, items)
    yield runner, graphs, mb
    mb.release()


def _tokens(n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(1000, 20000, (n,), generator=gen).tolist()


def decode_batch(runner: ModelRunner, mb: ManualBatches, seqs: list[int]):
    """One decode step of `seqs` (as the scheduler builds it), new slots allocated; the sequences'
    own lengths are not advanced, so the step can be run again or dropped."""
    n = len(seqs)
    slots = runner.allocator.alloc(n)
    rows, positions = [mb.rows[s] for s in seqs], [mb.slots[s].numel() for s in seqs]
    runner.req_to_token.write_tokens(rows, positions, slots)
    ids = [100 + 37 * s for s in seqs]
    plan = BatchPlan(ForwardMode.DECODE, ids, slots, rows, positions, [1] * n, list(range(n)))
    return runner.make_batch(plan), slots


def kv_snapshot(pool: KVPool) -> list[torch.Tensor]:
    return [t.clone() for t in pool.k + pool.v]


def kv_restore(pool: KVPool, snap: list[torch.Tensor]) -> None:
    for t, s in zip(pool.k + pool.v, snap):
        t.copy_(s)


def run_both(runner: ModelRunner, graphs: CudaGraphRunner, batch):
    """(plain logits, runner logits, plain KV, runner KV), each from the same pool state."""
    before = kv_snapshot(runner.kv_pool)
    want = runner.forward(batch)
    want_kv = kv_snapshot(runner.kv_pool)
    kv_restore(runner.kv_pool, before)
    got = graphs.replay(batch)
    got_kv = kv_snapshot(runner.kv_pool)
    kv_restore(runner.kv_pool, before)
    return want, got, want_kv, got_kv


def test_buckets_and_bucket_choice():
    assert BUCKETS == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]
    big = graph_buckets(256)
    assert big[:9] == [1, 2, 4, 8, 16, 24, 32, 40, 48] and big[-3:] == [224, 240, 256]
    assert graph_buckets(100)[-3:] == [80, 96, 100]
    runner = CudaGraphRunner.__new__(CudaGraphRunner)  # bucket_for reads only the buckets
    runner.buckets = BUCKETS
    assert [runner.bucket_for(b) for b in SIZES] == [1, 2, 4, 4, 8, 8, 16, 16, 20, 20]


def test_server_args_for_graphs():
    assert EngineArgs().graph_max_bs == 64  # max_running_requests' default
    assert EngineArgs(max_running_requests=1000).graph_max_bs == 256
    assert EngineArgs(max_running_requests=1000, cuda_graph_max_bs=512).graph_max_bs == 512
    assert EngineArgs(max_running_requests=8, cuda_graph_max_bs=32).graph_max_bs == 8
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineArgs(cuda_graph_max_bs=0)
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli(parser.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "48"]))
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 48


def test_dummy_slot_and_row_are_never_handed_out():
    pool = KVPool(16, 2, 2, 8, torch.float32, torch.device("cpu"))
    assert pool.dummy_slot == 16 and pool.k[0].shape[0] == 17
    table = ReqToTokenPool(4, 8, torch.device("cpu"), dummy_slot=pool.dummy_slot)
    assert table.dummy_row == 4 and table.host[table.dummy_row].tolist() == [16] * 8
    allocator = SlotAllocator(16, debug=True)
    assert sorted(allocator.alloc(16).tolist()) == list(range(16)) and allocator.num_free == 0
    assert sorted(table.alloc() for _ in range(4)) == [0, 1, 2, 3] and table.num_free == 0


@pytest.mark.parametrize("b", SIZES)
def test_every_bucket_matches_the_plain_forward(setup, b):
    runner, graphs, mb = setup
    batch, slots = decode_batch(runner, mb, list(range(b)))
    want, got, want_kv, got_kv = run_both(runner, graphs, batch)
    assert got.dtype == torch.float32 and got.shape == want.shape == (b, runner.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for w, g in zip(want_kv, got_kv):  # the real rows stored the same K/V
        torch.testing.assert_close(g[slots], w[slots], atol=1e-5, rtol=1e-5)
    runner.allocator.free(slots)


def test_cascade_batch_matches(setup):
    """Rows sharing a long cached prefix: the plain decode scores it once for all (cascade), the
    graph path attends each row's whole table row; same answer."""
    runner, graphs, _ = setup
    gen = torch.Generator().manual_seed(1)
    mb = ManualBatches(runner)
    mb.forward(ForwardMode.EXTEND, [(mb.new_seq(), _tokens(80, gen))])
    mb.forward(ForwardMode.EXTEND, [(mb.new_seq(shared_from=0, shared_len=70), _tokens(1 + i, gen))
                                    for i in range(5)])
    batch, slots = decode_batch(runner, mb, list(range(1, 6)))
    assert batch.shared_prefix_len == 70
    want, got, _, _ = run_both(runner, graphs, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    runner.allocator.free(slots)
    mb.release()


def test_replays_rewrite_the_static_buffers_in_place(setup):
    runner, graphs, mb = setup
    seen = []
    model = graphs.model

    def spy(fb):
        fields = ("input_ids", "positions", "out_cache_loc", "req_rows", "prefix_lens", "seq_lens", "kv_indptr",
                  "logits_indices")
        meta = fb.attn_metadata
        seen.append({"ptrs": [getattr(fb, f).data_ptr() for f in fields] + [meta.kv_index.data_ptr(),
                                                                              meta.mask.data_ptr()],
                     **{f: getattr(fb, f).clone() for f in fields}})
        return model(fb)

    graphs.model = spy
    try:
        before = kv_snapshot(runner.kv_pool)
        batches = []
        for b in (8, 5, 7, 3):  # 8, 5 and 7 share bucket 8; 5 follows 8, whose rows 5..7 must be reset
            batch, slots = decode_batch(runner, mb, list(range(b)))
            graphs.replay(batch)
            batches.append(batch)
            runner.allocator.free(slots)
        kv_restore(runner.kv_pool, before)
    finally:
        graphs.model = model
    assert seen[0]["ptrs"] == seen[1]["ptrs"] == seen[2]["ptrs"]
    assert seen[3]["input_ids"].data_ptr() != seen[0]["input_ids"].data_ptr()  # sanity: clones
    assert seen[3]["ptrs"][0] == seen[0]["ptrs"][0]  # bucket 4's views start where bucket 8's do
    for got, batch, bs in zip(seen, batches, (8, 8, 8, 4)):
        b, pad = batch.batch_size, bs - batch.batch_size
        for name in ("input_ids", "positions", "out_cache_loc", "req_rows", "prefix_lens", "seq_lens"):
            assert torch.equal(got[name][:b], getattr(batch, name)), name
        assert got["input_ids"][b:].tolist() == got["positions"][b:].tolist() == [0] * pad
        assert got["out_cache_loc"][b:].tolist() == [runner.kv_pool.dummy_slot] * pad
        assert got["req_rows"][b:].tolist() == [runner.req_to_token.dummy_row] * pad
        assert got["seq_lens"][b:].tolist() == [1] * pad and got["prefix_lens"][b:].tolist() == [0] * pad
        total = int(batch.kv_indptr[-1])
        assert got["kv_indptr"].tolist() == batch.kv_indptr.tolist() + list(range(total + 1, total + pad + 1))
        assert got["logits_indices"].tolist() == list(range(bs))


def test_padding_rows_write_only_the_dummy_slot(setup):
    runner, graphs, mb = setup
    pool, dummy = runner.kv_pool, runner.kv_pool.dummy_slot
    for t in pool.k + pool.v:
        t[dummy] = 1e4  # a sentinel: the padding rows' write must replace it
    before = kv_snapshot(pool)
    batch, slots = decode_batch(runner, mb, [0, 3, 4, 9, 17])  # bucket 8: 3 padding rows
    logits = graphs.replay(batch)
    assert logits.shape[0] == 5 and torch.isfinite(logits).all()
    changed = set()
    for old, new in zip(before, pool.k + pool.v):
        changed |= set((old != new).flatten(1).any(1).nonzero().flatten().tolist())
    assert changed == set(slots.tolist()) | {dummy}
    kv_restore(pool, before)
    runner.allocator.free(slots)


def test_which_runner_each_device_and_switch_gets(monkeypatch):
    """CUDA records where the model and the backend allow it; with graphs disabled it still pads decode
    to the buckets (the eager twin: a matmul's row may get other bits in another number of rows, and
    graphs on or off must not change an answer); where graphs would not be recorded, both run the
    plain forward; the CPU keeps its forward unless RADIXLM_CUDA_GRAPH_EAGER=1 asks for the twin."""
    from types import SimpleNamespace

    from radixlm.runtime.executor import cuda_graph

    made = []
    monkeypatch.setattr(cuda_graph, "CudaGraphRunner", lambda *a, record: made.append(record) or record)
    exact = SimpleNamespace(name="exact", supports_graphs=True, graph_exact=True)
    inexact = SimpleNamespace(name="inexact", supports_graphs=True, graph_exact=False)
    model = SimpleNamespace(graph_safe=True)

    def runner(backend, device, disable, twin=False, m=model):
        monkeypatch.setenv(EAGER_ENV, "1" if twin else "0")
        made.clear()
        cuda_graph.graph_runner_for(m, backend, None, None, torch.device(device), disable, 8)
        return made[0] if made else None

    assert runner(exact, "cuda", disable=False) is True
    assert runner(exact, "cuda", disable=True) is False
    assert runner(inexact, "cuda", disable=False) is None and runner(inexact, "cuda", disable=True) is None
    unsafe = SimpleNamespace(graph_safe=False)
    assert runner(exact, "cuda", disable=False, m=unsafe) is None and runner(exact, "cuda", True, m=unsafe) is None
    assert runner(exact, "cpu", disable=False) is None and runner(exact, "cpu", disable=True, twin=True) is None
    assert runner(inexact, "cpu", disable=False, twin=True) is False


def test_model_runner_replays_decode_batches_that_fit(tiny, monkeypatch):
    args = dict(model=str(tiny), max_total_tokens=512, max_running_requests=8, cuda_graph_max_bs=4,
                context_length=128)
    assert ModelRunner(EngineArgs(**args)).graph_runner is None  # the CPU forward stays as it is
    monkeypatch.setenv(EAGER_ENV, "1")
    assert ModelRunner(EngineArgs(**args, disable_cuda_graph=True)).graph_runner is None
    runner = ModelRunner(EngineArgs(**args))
    graphs = runner.graph_runner
    assert graphs is not None and not graphs.record and graphs.buckets == [1, 2, 4]
    mb = ManualBatches(runner)
    gen = torch.Generator().manual_seed(2)
    mb.forward(ForwardMode.EXTEND, [(mb.new_seq(), _tokens(3 + i, gen)) for i in range(5)])
    assert graphs.replays == 0  # extend runs the plain forward
    for seqs, replays in (([0, 1, 2], 1), ([0, 1, 2, 3, 4], 1)):  # 5 rows > max_bs 4: plain forward
        batch, slots = decode_batch(runner, mb, seqs)
        runner.forward(batch)
        assert graphs.replays == replays
        runner.allocator.free(slots)
    mb.release()
    assert runner.allocator.num_free == 512


# ------------------------------------------------------------------------------------- Engine level
FEW_SHOT = "Q: What is 2+2?\nA: 4\nQ: What color is grass?\nA: Green\nQ: "
PROMPTS = [FEW_SHOT + "What is the capital of France?\nA:", FEW_SHOT + "Name a planet.\nA:",
           "The best way to learn is", "def fibonacci(n):", "1, 2, 3, 4,", FEW_SHOT + "What is 3+5?\nA:"]
PARAMS = [  # kept short: each engine decodes on a CPU
    {"temperature": 0, "max_new_tokens": 24, "stop": [" and", "\nA:"]},
    {"temperature": 0, "max_new_tokens": 3},
    {"temperature": 0, "max_new_tokens": 28, "stop_token_ids": [28, 30]},
    {"temperature": 0, "max_new_tokens": 20, "min_new_tokens": 12},
    {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
    {"temperature": 0, "max_new_tokens": 12, "stop": ["\n"]},
]


def assert_same(a: dict, b: dict) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]


@pytest.mark.slow
def test_engine_answers_equal_with_the_runner_on_and_off(smollm_folder):
    common = dict(model=str(smollm_folder), max_total_tokens=4096, context_length=512, max_running_requests=16,
                  log_level="warning")
    with Engine(**common) as plain:
        assert plain.runner.graph_runner is None
        want = plain.generate(PROMPTS, PARAMS)
    assert {o["meta_info"]["finish_reason"]["type"] for o in want} >= {"stop", "length"}
    for overlap_off in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(EAGER_ENV, "1")
            engine = Engine(**common, disable_overlap_schedule=overlap_off)
        with engine:
            got = engine.generate(PROMPTS, PARAMS)
            for a, b in zip(got, want):
                assert_same(a, b)
            info = engine.get_server_info()
            assert engine.runner.graph_runner.replays > 0
            assert overlap_off or info["overlapped_steps"] > 0
            assert info["free_slots"] + info["cache"]["evictable_size"] == info["max_total_tokens"]
            assert info["kv_check"] == "ok", info["kv_check"]


# ------------------------------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def cuda_model(request) -> Path:
    """The GPU machine's random SmolLM2-shaped model (../shared/gpu/run.sh builds it), else a tiny one."""
    built = Path(os.environ.get("RADIXLM_GPU_MODELS", "/nonexistent")) / "tiny"
    return built if (built / "config.json").exists() else request.getfixturevalue("make_tiny_model")()


@pytest.mark.cuda
def test_recorded_graphs_match_the_plain_forward(cuda_model):
    runner = ModelRunner(EngineArgs(model=str(cuda_model), device="cuda", dtype="float32", context_length=512,
                                    max_total_tokens=4096, max_running_requests=MAX_BS))
    graphs = runner.graph_runner
    assert graphs is not None and graphs.record and graphs.buckets == BUCKETS
    gen = torch.Generator().manual_seed(0)
    mb = ManualBatches(runner)
    mb.forward(ForwardMode.EXTEND, [(mb.new_seq(), _tokens(12, gen))])
    mb.forward(ForwardMode.EXTEND, [(mb.new_seq(shared_from=0, shared_len=9) if i % 2 else mb.new_seq(),
                                     _tokens(1 + (7 * i) % 13, gen)) for i in range(1, MAX_BS)])
    for b in SIZES:
        batch, slots = decode_batch(runner, mb, list(range(b)))
        before = kv_snapshot(runner.kv_pool)
        runner.attn_backend.init_forward_metadata(batch)
        want = runner.model(batch).float()
        kv_restore(runner.kv_pool, before)
        replays = graphs.replays
        got = runner.forward(batch)
        assert graphs.replays == replays + 1
        kv_restore(runner.kv_pool, before)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), b
        runner.allocator.free(slots)
    mb.release()


@pytest.mark.cuda
@pytest.mark.parametrize("overlap_off", [False, True])
def test_engine_on_cuda_answers_equal_with_graphs_on_and_off(cuda_model, overlap_off):
    common = dict(model=str(cuda_model), device="cuda", dtype="float32", context_length=512,
                  max_total_tokens=4096, max_running_requests=16, disable_overlap_schedule=overlap_off,
                  log_level="warning")
    params = [{**p, "ignore_eos": True} for p in PARAMS]  # random weights: EOS would end rows at random
    with Engine(**common, disable_cuda_graph=True) as plain:
        want = plain.generate(PROMPTS, params)
    with Engine(**common) as engine:
        assert engine.runner.graph_runner.record
        got = engine.generate(PROMPTS, params)
        assert engine.runner.graph_runner.replays > 0
    for a, b in zip(got, want):
        assert_same(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("arch,overrides", [
    ("Qwen3MoeForCausalLM", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                             "norm_topk_prob": True, "mlp_only_layers": [1]}),
    ("Gemma3ForCausalLM", {"head_dim": 32, "sliding_window": 12, "query_pre_attn_scalar": 24, "num_hidden_layers": 3,
                           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
])
def test_experts_and_sliding_windows_record_graphs_with_the_eager_answers(make_tiny_model, arch, overrides):
    """Routed experts (the fused kernels) and Gemma 3's sliding layers (windows in the Triton kernels)
    read nothing on the host, so their decode is recorded: greedy tokens equal those with graphs off,
    prompts past the window and behind a shared prefix included."""
    folder = make_tiny_model(arch, seed=2, initializer_range=0.2, **overrides)
    common = dict(model=str(folder), device="cuda", dtype="float32", context_length=256, max_total_tokens=4096,
                  max_running_requests=16, log_level="warning")
    prefix = list(range(200, 270))
    prompts = [prefix + [7 + i] for i in range(6)] + [list(range(300, 300 + 5 * i)) for i in range(1, 5)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(**common, disable_cuda_graph=True) as plain:
        want = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    with Engine(**common) as engine:
        assert engine.runner.graph_runner is not None and engine.runner.graph_runner.record
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        assert engine.runner.graph_runner.replays > 0
    assert got == want
