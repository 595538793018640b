"""Attention backends against a dense per-request reference, on random mixes of batch shapes.

Batches mix requests with no cached prefix, private cached prefixes and prefixes shared through
the same slots (the cascade path), in extend mode (prompts, chunks, 1-token rows riding along) and
in decode mode. The reference attends each request's full key sequence in float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.executor import forward_batch
from radixlm.runtime.executor.attention import cpu_blocked, create_attention_backend, decode_kv, torch_backend
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardBatch, ForwardMode
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool
from radixlm.runtime.executor.models.linear import onednn_usable

ONEDNN = onednn_usable(torch.device("cpu"), torch.float32) is None
GEMMS = ["torch", "onednn"] if ONEDNN else ["torch"]

HEADS, KV_HEADS, DIM = 4, 2, 8
SLOTS, MAX_CONTEXT = 512, 128


def _case(draw, mode: ForwardMode):
    n_req = draw(st.integers(1, 5))
    shared_len = draw(st.sampled_from([0, 0, 3, 9]))
    reqs = []
    for _ in range(n_req):
        shares = shared_len > 0 and draw(st.booleans())
        private = draw(st.integers(0, 7))
        if mode is ForwardMode.DECODE and not shares and private == 0:
            private = 1  # a decode row always has something before its token
        new = 1 if mode is ForwardMode.DECODE else draw(st.integers(1, 6))
        reqs.append((shares, private, new))
    return shared_len, reqs


@st.composite
def batches(draw):
    mode = draw(st.sampled_from([ForwardMode.EXTEND, ForwardMode.DECODE]))
    return mode, *_case(draw, mode)


def _build(mode, shared_len, reqs, seed):
    """Pool with random K/V for every cached slot; the plan of the new tokens; q/k/v for them."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(SLOTS, 1, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    table = ReqToTokenPool(8, MAX_CONTEXT, torch.device("cpu"))
    free = iter(torch.randperm(SLOTS, generator=gen).tolist())
    shared = torch.tensor([next(free) for _ in range(shared_len)], dtype=torch.int64)
    ids, new_slots, rows, prefix, lens, full = [], [], [], [], [], []
    for shares, private, new in reqs:
        row = table.alloc()
        cached = torch.cat([shared if shares else torch.empty(0, dtype=torch.int64),
                            torch.tensor([next(free) for _ in range(private)], dtype=torch.int64)])
        fresh = torch.tensor([next(free) for _ in range(new)], dtype=torch.int64)
        table.write(row, 0, torch.cat([cached, fresh]))
        ids += [0] * new
        new_slots.append(fresh)
        rows.append(row)
        prefix.append(cached.numel())
        lens.append(new)
        full.append(torch.cat([cached, fresh]))
    t = sum(lens)
    plan = BatchPlan(mode, ids, torch.cat(new_slots), rows, prefix, lens, list(range(t)))
    batch = ForwardBatch.build(plan, table, pool, torch.device("cpu"))
    q = torch.randn(t, HEADS, DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, DIM, generator=gen)
    return batch, pool, q, k, v, full, prefix, lens


def _reference(pool, q, k, v, full, prefix, lens):
    keys_all, values_all = pool.k[0].double().clone(), pool.v[0].double().clone()
    out, start = [], 0
    for slots, p, n in zip(full, prefix, lens):
        keys_all[slots[p:]] = k[start : start + n].double()
        values_all[slots[p:]] = v[start : start + n].double()
        start += n
    start = 0
    group = HEADS // KV_HEADS
    for slots, p, n in zip(full, prefix, lens):
        keys = keys_all[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        values = values_all[slots].repeat_interleave(group, dim=1)
        qs = q[start : start + n].double()  # [n, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * DIM**-0.5
        visible = torch.arange(p + n)[None, :] <= torch.arange(p, p + n)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        start += n
    return torch.cat(out)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=batches(), seed=st.integers(0, 2**16), gemm=st.sampled_from(GEMMS), block=st.sampled_from([2, 3, 128]))
def test_torch_backend_matches_dense_reference(case, seed, gemm, block):
    mode, shared_len, reqs = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forward_batch, "CASCADE_MIN_SHARED", 3)  # so small random batches take the cascade path
        batch, pool, q, k, v, full, prefix, lens = _build(mode, shared_len, reqs, seed)
    want = _reference(pool, q, k, v, full, prefix, lens)
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_blocked, "beats_sdpa", lambda *shape: True)  # whichever is faster on this CPU
        backend.set_gemm(gemm)
    with pytest.MonkeyPatch.context() as mp:
        # small rows take the blocked oneDNN kernel too, in blocks that split them
        mp.setattr(cpu_blocked, "MIN_PAIRS", 1)
        mp.setattr(cpu_blocked, "BLOCK", block)
        backend.init_forward_metadata(batch)
        got = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    sharing = sum(s for s, _, _ in reqs)
    if len(reqs) > 1 and sharing == len(reqs) and shared_len >= 3:
        assert batch.shared_prefix_len >= shared_len  # the cascade path really ran


def test_every_extend_path_matches_the_reference():
    """One extend batch with each path: no prefix (causal), a prefix shorter than the new part
    (zero queries in front), a longer one (bottom-right mask) and one-token rows (one batched call)."""
    reqs = [(False, 0, 6), (False, 2, 5), (False, 7, 3), (False, 4, 1), (False, 9, 1), (False, 1, 1)]
    batch, pool, q, k, v, full, prefix, lens = _build(ForwardMode.EXTEND, 0, reqs, seed=5)
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    backend.init_forward_metadata(batch)
    meta = batch.attn_metadata
    assert meta.masks[0] is None and meta.masks[1] == 2 and isinstance(meta.masks[2], torch.Tensor)
    assert meta.singles is not None and meta.singles.index == [3, 4, 5]
    got = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got.double(), _reference(pool, q, k, v, full, prefix, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ONEDNN, reason="this torch build has no usable oneDNN matmul")
def test_blocked_kernel_takes_long_rows_with_and_without_a_prefix(monkeypatch):
    """With oneDNN chosen, rows with enough (query, key) pairs go to the blocked kernel, split into
    several blocks (the last one partial), with a cached prefix or none; short rows stay on SDPA."""
    monkeypatch.setattr(cpu_blocked, "MIN_PAIRS", 40)
    monkeypatch.setattr(cpu_blocked, "BLOCK", 4)
    reqs = [(False, 0, 11), (False, 23, 9), (False, 2, 3), (False, 5, 1), (False, 9, 1)]
    batch, pool, q, k, v, full, prefix, lens = _build(ForwardMode.EXTEND, 0, reqs, seed=7)
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    monkeypatch.setattr(cpu_blocked, "beats_sdpa", lambda *shape: True)  # whichever is faster on this CPU
    backend.set_gemm("onednn")
    backend.init_forward_metadata(batch)
    meta = batch.attn_metadata
    assert meta.masks[:2] == ["blocked", "blocked"] and meta.masks[2] == 2  # 3 x 5 pairs < 40: SDPA
    got = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got.double(), _reference(pool, q, k, v, full, prefix, lens), atol=1e-5, rtol=1e-5)
    backend.set_gemm("torch")
    backend.init_forward_metadata(batch)
    assert "blocked" not in batch.attn_metadata.masks


def test_bf16_extends_round_only_rows_with_enough_pairs(monkeypatch):
    """With bfloat16 extends on (an int4 model on a CPU with bfloat16 dot products), rows with
    BF16_MIN_PAIRS (query, key) pairs attend in bfloat16, on every extend path and with oneDNN chosen
    too (SDPA then beats the blocked kernel); shorter rows keep float32's answer to the bit."""
    monkeypatch.setattr(torch_backend, "BF16_MIN_PAIRS", 40)
    reqs = [(False, 0, 11), (False, 23, 9), (False, 2, 3), (False, 4, 1), (False, 9, 1), (False, 1, 1)]
    batch, pool, q, k, v, full, prefix, lens = _build(ForwardMode.EXTEND, 0, reqs, seed=13)
    want = _reference(pool, q, k, v, full, prefix, lens)
    exact = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    exact.init_forward_metadata(batch)
    plain = exact.forward(q, k, v, 0, batch)
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    monkeypatch.setattr(cpu_blocked, "beats_sdpa", lambda *shape: True)
    backend.set_gemm("onednn" if ONEDNN else "torch")
    backend.set_bf16_extends(True)
    backend.init_forward_metadata(batch)
    assert "blocked" not in batch.attn_metadata.masks
    got = backend.forward(q, k, v, 0, batch)
    long_rows = slice(0, 11 + 9)  # 11 x 11 and 9 x 32 pairs; the rest have at most 3 x 5
    assert not torch.equal(got[long_rows], plain[long_rows])
    torch.testing.assert_close(got[long_rows].double(), want[long_rows], atol=0.03, rtol=0.03)
    assert torch.equal(got[long_rows.stop:], plain[long_rows.stop:])


@pytest.mark.parametrize("flash", [True, False])
def test_bf16_extends_behind_a_shared_prefix(monkeypatch, flash):
    """Requests sharing a cached prefix, bfloat16 extends on: with SDPA's CPU flash kernel the prefix
    is scored once in bfloat16 and merged with each request's own keys; without it each row attends
    on its own (the float32 cascade is slower than either). Decodes keep their cascade."""
    monkeypatch.setattr(forward_batch, "CASCADE_MIN_SHARED", 3)
    monkeypatch.setattr(torch_backend, "BF16_MIN_PAIRS", 1)
    if not flash:
        monkeypatch.setattr(torch_backend, "_FLASH_CPU", None)
    elif torch_backend._FLASH_CPU is None:
        pytest.skip("this torch build has no CPU flash kernel")
    reqs = [(True, private, new) for private, new in zip([2, 1, 3, 0], [5, 4, 1, 6])]
    batch, pool, q, k, v, full, prefix, lens = _build(ForwardMode.EXTEND, 9, reqs, seed=17)
    assert batch.shared_prefix_len == 9
    want = _reference(pool, q, k, v, full, prefix, lens)
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    backend.set_bf16_extends(True)
    backend.init_forward_metadata(batch)
    assert (batch.attn_metadata.shared is not None) == flash
    got = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got.double(), want, atol=0.03, rtol=0.03)
    assert (got.double() - want).abs().max() > 1e-5  # it did run in bfloat16
    decode, *_ = _build(ForwardMode.DECODE, 9, [(True, 2, 1), (True, 1, 1)], seed=17)
    backend.init_forward_metadata(decode)
    assert decode.attn_metadata.shared is not None


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_cascade_paths_match_the_reference(monkeypatch, gemm, mode):
    """Every request shares a cached prefix: its keys are scored once for the whole batch and merged
    with each request's own (masked, for several new tokens) keys, on either matmul kernel."""
    monkeypatch.setattr(forward_batch, "CASCADE_MIN_SHARED", 3)
    news = [5, 4, 1] if mode is ForwardMode.EXTEND else [1, 1, 1]
    reqs = [(True, private, new) for private, new in zip([2, 1, 3], news)]
    batch, pool, q, k, v, full, prefix, lens = _build(mode, 9, reqs, seed=11)
    assert batch.shared_prefix_len == 9
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    backend.set_gemm(gemm)
    backend.init_forward_metadata(batch)
    got = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got.double(), _reference(pool, q, k, v, full, prefix, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flash", [True, False])
def test_decodes_keep_the_shared_prefix_until_an_extend(monkeypatch, flash):
    """Consecutive decodes behind the same shared prefix gather its K/V once and keep them (scored on
    SDPA's CPU kernel, or `_partial` where a build lacks it); an extend drops them, so a decode after it
    reads the pool again."""
    monkeypatch.setattr(forward_batch, "CASCADE_MIN_SHARED", 3)
    if not flash:
        monkeypatch.setattr(torch_backend, "_FLASH_CPU", None)
    reqs = [(True, private, 1) for private in (2, 1, 3)]
    batch, pool, q, k, v, full, prefix, lens = _build(ForwardMode.DECODE, 9, reqs, seed=11)
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    backend.init_forward_metadata(batch)
    first = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(first.double(), _reference(pool, q, k, v, full, prefix, lens), atol=1e-5, rtol=1e-5)
    kept = backend._shared_kv
    assert kept is not None and set(kept.layers) == {0} and kept.nbytes == 2 * 9 * KV_HEADS * DIM * 4

    shared = batch.attn_metadata.shared
    pool.k[0][shared] += 1.0  # never happens between decodes (decode_kv.py); shows which copy a step reads
    backend.init_forward_metadata(batch)
    assert backend._shared_kv is kept
    torch.testing.assert_close(backend.forward(q, k, v, 0, batch), first)  # the kept copy, not the pool

    backend.init_forward_metadata(_build(ForwardMode.EXTEND, 0, [(False, 0, 3)], seed=1)[0])
    assert backend._shared_kv is None
    backend.init_forward_metadata(batch)
    again = backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(again.double(), _reference(pool, q, k, v, full, prefix, lens), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(again, first)
    backend._shared_kv = None  # as on a GPU: the prefix gathered within the step, nothing kept
    torch.testing.assert_close(backend.forward(q, k, v, 0, batch), again)


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(privates=st.lists(st.integers(1, 6), min_size=1, max_size=4), shared_len=st.sampled_from([0, 9]),
       steps=st.integers(1, 12), seed=st.integers(0, 2**16), flash=st.booleans())
def test_consecutive_decodes_keep_each_rows_keys(privates, shared_len, steps, seed, flash):
    """Decode steps of the same rows keep their own keys (and the shared prefix's) from one step to the
    next, adding each new token's K/V, and gather again only when the rows change (the last step drops
    a row) or a row outgrows the kept width (blocks of 4 here); every step equals the reference."""
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(SLOTS, 1, KV_HEADS, DIM, torch.float32, cpu)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    table = ReqToTokenPool(8, MAX_CONTEXT, cpu)
    free = iter(torch.randperm(SLOTS, generator=gen).tolist())
    shared = [next(free) for _ in range(shared_len)]
    rows, held = [], []
    for private in privates:
        rows.append(table.alloc())
        held.append(shared + [next(free) for _ in range(private)])
        table.write(rows[-1], 0, torch.tensor(held[-1]))
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    gathers, segments, last = [], 0, None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(forward_batch, "CASCADE_MIN_SHARED", 3)
        mp.setattr(decode_kv, "BLOCK", 4)
        if not flash:
            mp.setattr(torch_backend, "_FLASH_CPU", None)
        gather = decode_kv.gather
        mp.setattr(decode_kv, "gather", lambda *a: gathers.append(1) or gather(*a))
        for step in range(steps):
            if step == steps - 1 and len(rows) > 1:
                rows, held = rows[:-1], held[:-1]
            for row, slots in zip(rows, held):
                slots.append(next(free))
                table.write(row, len(slots) - 1, torch.tensor(slots[-1:]))
            prefix = [len(slots) - 1 for slots in held]
            plan = BatchPlan(ForwardMode.DECODE, [0] * len(rows), torch.tensor([s[-1] for s in held]), list(rows),
                             prefix, [1] * len(rows), list(range(len(rows))))
            batch = ForwardBatch.build(plan, table, pool, cpu)
            q = torch.randn(len(rows), HEADS, DIM, generator=gen)
            k = torch.randn(len(rows), KV_HEADS, DIM, generator=gen)
            v = torch.randn(len(rows), KV_HEADS, DIM, generator=gen)
            want = _reference(pool, q, k, v, [torch.tensor(s) for s in held], prefix, [1] * len(rows))
            backend.init_forward_metadata(batch)
            got = backend.forward(q, k, v, 0, batch)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
            p = batch.shared_prefix_len
            width = -(-(max(len(s) for s in held) - p) // 4) * 4
            segments += (tuple(rows), p, width) != last
            last = (tuple(rows), p, width)
            assert backend._own_kv.layers[0].step == backend._step
    assert len(gathers) == segments  # one gather per run of steps over the same rows and width


def test_cascade_threshold_respected():
    batch, *_ = _build(ForwardMode.DECODE, 9, [(True, 1, 1), (True, 2, 1)], seed=0)
    assert batch.shared_prefix_len == 0  # 9 < the default CASCADE_MIN_SHARED
    batch, *_ = _build(ForwardMode.DECODE, 70, [(True, 1, 1), (True, 2, 1)], seed=0)
    assert batch.shared_prefix_len == 70


@settings(max_examples=examples(80), deadline=None)
@example(shared=70, program=[("decode", 0, 0), ("renew", 0, 0)])
@example(shared=0, program=[("decode", 0, 0), ("rewrite", 1, 80), ("rewrite", 0, 80)])
@given(shared=st.one_of(st.integers(0, 90), st.integers(64, 90)),
       program=st.lists(st.tuples(st.sampled_from(["decode", "rewrite", "renew"]), st.integers(0, 2),
                                  st.integers(0, 120)), max_size=30))
def test_the_shared_prefix_memo_equals_a_fresh_comparison(shared, program):
    """Consecutive decode steps reuse the shared-prefix length; a row rewritten (the cache handing it
    its own slots), given back and handed out again, must be compared again. Every step's length
    equals a comparison of the table from scratch."""
    table = ReqToTokenPool(4, 512, torch.device("cpu"))
    fresh = iter(range(10_000, 1_000_000))
    common = [next(fresh) for _ in range(shared)]
    rows = [table.alloc() for _ in range(3)]
    lens = {}
    for i, row in enumerate(rows):
        lens[row] = shared + 20 + i
        table.write(row, 0, torch.tensor(common + [next(fresh) for _ in range(20 + i)]))

    def expected(plan):
        limit = min(plan.prefix_lens)
        block = table.host[plan.req_rows, :limit]
        n = int((block == block[:1]).all(0).to(torch.int8).cumprod(0).sum())
        return n if n >= forward_batch.CASCADE_MIN_SHARED else 0

    for op, which, k in program + [("decode", 0, 0)]:
        row, other = rows[which], rows[(which + 1) % 3]
        if op == "rewrite":  # its first k slots become the other row's (as a cache dedupe does)
            k = min(k, lens[row], lens[other])
            table.write(row, 0, table.host[other, :k].clone())
        elif op == "renew":  # given back and handed out again, with a prefix of its own
            table.free(row)
            rows[which] = row = table.alloc()
            table.write(row, 0, torch.tensor([next(fresh) for _ in range(lens[row])]))
        positions = [lens[r] for r in rows]
        new = torch.tensor([next(fresh) for _ in rows])
        table.write_tokens(rows, positions, new)
        plan = BatchPlan(ForwardMode.DECODE, [0] * 3, new, list(rows), positions, [1] * 3, [0, 1, 2])
        assert forward_batch._shared_prefix_len(table, plan) == expected(plan)
        for r in rows:
            lens[r] += 1


def test_graph_hooks_replay_new_metadata_into_static_buffers():
    """Capture plans into static buffers; replay rewrites them in place and gives the eager result."""
    backend = create_attention_backend("torch", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM)
    assert backend.supports_graphs
    backend.init_graph_state(max_bs=4, max_context=MAX_CONTEXT, device=torch.device("cpu"))
    first, *_ = _build(ForwardMode.DECODE, 0, [(False, 3, 1), (False, 5, 1)], seed=1)
    backend.init_forward_metadata_capture(first)
    static = first.attn_metadata
    second, pool, q, k, v, full, prefix, lens = _build(ForwardMode.DECODE, 0, [(False, 7, 1), (False, 2, 1)], seed=2)
    backend.init_forward_metadata_replay(second)
    assert second.attn_metadata.kv_index.data_ptr() == static.kv_index.data_ptr()
    assert second.attn_metadata.mask.data_ptr() == static.mask.data_ptr()
    want = _reference(pool, q, k, v, full, prefix, lens)
    got = backend.forward(q, k, v, 0, second)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_batch_is_flat_and_on_one_device():
    batch, *_ = _build(ForwardMode.EXTEND, 0, [(False, 2, 3), (False, 0, 4)], seed=3)
    assert batch.qo_indptr.tolist() == [0, 3, 7]
    assert batch.kv_indptr.tolist() == [0, 5, 9]
    assert batch.positions.tolist() == [2, 3, 4, 0, 1, 2, 3]
    assert batch.kv_indices.numel() == 9
    for name in ("input_ids", "positions", "out_cache_loc", "qo_indptr", "kv_indptr", "kv_indices", "seq_lens",
                 "prefix_lens", "logits_indices", "req_rows"):
        assert getattr(batch, name).device.type == "cpu"
        assert getattr(batch, name).dtype == torch.int64


FIELDS = ("input_ids", "positions", "out_cache_loc", "req_rows", "prefix_lens", "seq_lens", "qo_indptr", "kv_indptr",
          "logits_indices", "seq_lens_host", "extend_lens_host", "shared_prefix_len")


@settings(max_examples=examples(40), deadline=None)
@given(prefixes=st.lists(st.integers(1, 100), min_size=1, max_size=9), seed=st.integers(0, 2**16))
def test_host_decode_batch_equals_the_general_one(prefixes, seed):
    """A CPU decode batch is built from Python sums in one tensor call (`_host_decode`); the general path
    (tensor ops, whose results a device copy packs) gives the same tensors and host lists for the same plan."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(SLOTS, 1, KV_HEADS, DIM, torch.float32, torch.device("cpu"))
    table = ReqToTokenPool(16, MAX_CONTEXT, torch.device("cpu"))
    slots = torch.randperm(SLOTS, generator=gen)[: len(prefixes)]
    rows = [table.alloc() for _ in prefixes]
    ids = torch.randint(0, 1000, (len(prefixes),), generator=gen).tolist()
    plan = BatchPlan(ForwardMode.DECODE, ids, slots, rows, prefixes, [1] * len(prefixes), list(range(len(prefixes))))
    fast = ForwardBatch.build(plan, table, pool, torch.device("cpu"))
    table.shared = False  # the general path (it also writes the new slots into the same table)
    try:
        packed = ForwardBatch.build(plan, table, pool, torch.device("cpu"))
    finally:
        table.shared = True
    for name in FIELDS:
        a, b = getattr(fast, name), getattr(packed, name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b), name
        else:
            assert a == b, name
    assert fast.positions.tolist() == prefixes and fast.seq_lens.tolist() == [p + 1 for p in prefixes]
