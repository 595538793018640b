"""The batch-invariant attention backend: close to the torch backend, and bitwise the same for a
query whatever else is computed with it (a batch of decodes, a whole prefill, a cached extension,
a chunk), which the torch backend is not. The probe and the extend's arithmetic, each against the bits
of the one product it replaces, are in tests/test_invariant_attention_kernels.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.executor.attention import (
    create_attention_backend,
    decode_kv,
    invariant_backend,
    resolve_backend_name,
)
from radixlm.runtime.executor.attention.torch_backend import TorchAttentionBackend
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardBatch, ForwardMode
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool

CPU = torch.device("cpu")
SHAPES = [(9, 3, 64), (4, 2, 16), (4, 4, 64), (8, 1, 64), (8, 2, 128)]  # (heads, KV heads, head dim)


class Scene:
    """One layer's pool with random K/V, requests laid out in scattered slots, and one query per
    position of each request (so the same query can be asked in different batches)."""

    def __init__(self, shape, lengths: list[int], seed: int, shared: int = 0):
        self.heads, self.kv_heads, self.dim = shape
        gen = torch.Generator().manual_seed(seed)
        total = sum(lengths)
        self.pool = KVPool(total + 8, 1, self.kv_heads, self.dim, torch.float32, CPU)
        for t in (self.pool.k[0], self.pool.v[0]):
            t.copy_(torch.randn(t.shape, generator=gen))
        self.table = ReqToTokenPool(len(lengths) + 1, max(lengths) + 1, CPU)
        slots = torch.randperm(total, generator=gen)
        common, slots = slots[:shared], slots[shared:]  # the first `shared` slots of every request
        self.rows, self.queries = [], []
        for n in lengths:
            row = self.table.alloc()
            self.table.write(row, 0, torch.cat([common, slots[: n - shared]]))
            slots = slots[n - shared :]
            self.rows.append(row)
            self.queries.append(torch.randn(n, self.heads, self.dim, generator=gen))

    def run(self, backend, mode: ForwardMode, picks: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """picks: (request, first new position, end) -> each request's outputs for those positions.
        The new tokens' K/V are already in the pool: the step rewrites them with the same values."""
        rows = [self.rows[r] for r, _, _ in picks]
        prefix = [lo for _, lo, _ in picks]
        new = [hi - lo for _, lo, hi in picks]
        slots = torch.cat([self.table.host[self.rows[r], lo:hi] for r, lo, hi in picks])
        t = sum(new)
        batch = ForwardBatch.build(BatchPlan(mode, [0] * t, slots, rows, prefix, new, list(range(t))),
                                   self.table, self.pool, CPU)
        q = torch.cat([self.queries[r][lo:hi] for r, lo, hi in picks])
        k, v = self.pool.k[0][slots].clone(), self.pool.v[0][slots].clone()
        backend.init_forward_metadata(batch)
        out = backend.forward(q, k, v, 0, batch)
        return list(out.split(new))


def invariant(scene: Scene):
    return create_attention_backend("invariant", num_heads=scene.heads, num_kv_heads=scene.kv_heads,
                                    head_dim=scene.dim)


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(SHAPES), lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_decode_equals_torch_and_does_not_depend_on_the_batch(shape, lengths, seed):
    scene = Scene(shape, lengths, seed)
    backend = invariant(scene)
    last = [(r, n - 1, n) for r, n in enumerate(lengths)]
    together = scene.run(backend, ForwardMode.DECODE, last)
    want = scene.run(TorchAttentionBackend(*shape), ForwardMode.DECODE, last)
    for r, pick in enumerate(last):
        torch.testing.assert_close(together[r], want[r], atol=1e-5, rtol=1e-5)
        assert torch.equal(scene.run(backend, ForwardMode.DECODE, [pick])[0], together[r])


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(SHAPES), length=st.integers(2, 400), data=st.data())
def test_a_position_gets_the_same_bits_in_a_prefill_an_extension_a_chunk_and_a_decode(shape, length, data):
    seed = data.draw(st.integers(0, 2**16))
    other = data.draw(st.integers(1, 200))
    scene = Scene(shape, [length, other], seed)
    backend = invariant(scene)
    whole = scene.run(backend, ForwardMode.EXTEND, [(0, 0, length)])[0]
    want = scene.run(TorchAttentionBackend(*shape), ForwardMode.EXTEND, [(0, 0, length)])[0]
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    cut = data.draw(st.integers(1, length - 1))
    # a cached prefix, beside another request's prefill
    ext, _ = scene.run(backend, ForwardMode.EXTEND, [(0, cut, length), (1, 0, other)])
    assert torch.equal(ext, whole[cut:])
    # the last position as a decode, in a batch with a longer or shorter row
    dec = scene.run(backend, ForwardMode.DECODE, [(1, other - 1, other), (0, length - 1, length)])[1]
    assert torch.equal(dec[0], whole[-1])


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared=st.integers(64, 300), extra=st.lists(st.integers(1, 200), min_size=2, max_size=6),
       seed=st.integers(0, 2**16))
def test_a_prefix_every_row_shares_is_read_once_with_the_same_bits(shared, extra, seed):
    """Rows holding the same leading slots (few-shot, fork, n > 1): their whole shared blocks are
    scored for all rows at once; each row still equals its decode alone."""
    lengths = [shared + n for n in extra]
    scene = Scene((9, 3, 64), lengths, seed, shared=shared)
    backend = invariant(scene)
    last = [(r, n - 1, n) for r, n in enumerate(lengths)]
    together = scene.run(backend, ForwardMode.DECODE, last)
    assert backend_used_shared_blocks(scene, backend, last)
    want = scene.run(TorchAttentionBackend(9, 3, 64), ForwardMode.DECODE, last)
    for r, pick in enumerate(last):
        torch.testing.assert_close(together[r], want[r], atol=1e-5, rtol=1e-5)
        assert torch.equal(scene.run(backend, ForwardMode.DECODE, [pick])[0], together[r])


def _batch(scene, picks, mode: ForwardMode) -> ForwardBatch:
    rows = [scene.rows[r] for r, _, _ in picks]
    slots = torch.cat([scene.table.host[scene.rows[r], lo:hi] for r, lo, hi in picks])
    new = [hi - lo for _, lo, hi in picks]
    plan = BatchPlan(mode, [0] * sum(new), slots, rows, [lo for _, lo, _ in picks], new, list(range(sum(new))))
    return ForwardBatch.build(plan, scene.table, scene.pool, CPU)


def backend_used_shared_blocks(scene, backend, picks, mode: ForwardMode = ForwardMode.DECODE) -> bool:
    batch = _batch(scene, picks, mode)
    backend.init_forward_metadata(batch)
    return batch.attn_metadata.shared is not None


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(SHAPES[:3]), shared=st.integers(64, 300), data=st.data())
def test_extends_behind_a_shared_prefix_score_it_once_with_the_same_bits(shape, shared, data):
    """Several requests extending behind the same cached prefix (the first turn of clients sharing a
    system prompt, once it is cached): the shared blocks are gathered and scored once for every
    chunk of the step; each request's outputs equal its extend alone and its whole prefill, also when
    the shared rows are split into waves."""
    seed = data.draw(st.integers(0, 2**16))
    cached = data.draw(st.lists(st.integers(0, 80), min_size=2, max_size=5))  # past the shared part
    new = data.draw(st.lists(st.integers(1, 150), min_size=len(cached), max_size=len(cached)))
    lengths = [shared + c + n for c, n in zip(cached, new)]
    scene = Scene(shape, lengths, seed, shared=shared)
    backend = invariant(scene)
    picks = [(r, shared + c, n) for r, (c, n) in enumerate(zip(cached, lengths))]
    assert backend_used_shared_blocks(scene, backend, picks, ForwardMode.EXTEND)
    together = scene.run(backend, ForwardMode.EXTEND, picks)
    with pytest.MonkeyPatch.context() as mp:  # a wave's scores bounded to those of ~40 tokens' rows
        mp.setattr(invariant_backend, "CHUNK_ELEMS", shape[0] * max(lengths) * 40)
        plan = backend._extend_plan(_batch(scene, picks, ForwardMode.EXTEND))

        def held(wave: list[int]) -> int:  # score elements a wave holds at once
            return sum(max((plan.chunks[i].hi - plan.chunks[i].lo) * backend.group, backend.min_rows)
                       * backend.num_kv_heads * plan.chunks[i].width for i in wave)

        assert [i for wave in plan.waves for i in wave] == list(range(len(plan.chunks)))
        assert all(held(w) <= invariant_backend.CHUNK_ELEMS or len(w) == 1 for w in plan.waves)
        if held(range(len(plan.chunks))) > invariant_backend.CHUNK_ELEMS and len(plan.chunks) > 1:
            assert len(plan.waves) > 1
        in_waves = scene.run(backend, ForwardMode.EXTEND, picks)
    for r, pick in enumerate(picks):
        assert torch.equal(scene.run(backend, ForwardMode.EXTEND, [pick])[0], together[r])
        assert torch.equal(scene.run(backend, ForwardMode.EXTEND, [(r, 0, lengths[r])])[0][pick[1]:], together[r])
        assert torch.equal(in_waves[r], together[r])


def test_decodes_behind_the_same_shared_blocks_reuse_their_gather_until_an_extend(monkeypatch):
    """Consecutive decodes behind the same shared slots gather those blocks once (the same bits as
    gathering them every step); a decode behind other slots, a lone row, another pool and any extend
    start over, and after an extend the decode reads what the pool holds then."""
    shared, extra = 200, [30, 90, 5]
    lengths = [shared + n for n in extra]
    scene = Scene((9, 3, 64), lengths, seed=7, shared=shared)
    backend = invariant(scene)
    gathered: list[int] = []
    real = decode_kv.gather
    monkeypatch.setattr(decode_kv, "gather",
                        lambda pool, layer, index, rows, kvh, width: gathered.append(width) or
                        real(pool, layer, index, rows, kvh, width))
    last = [(r, n - 1, n) for r, n in enumerate(lengths)]
    first = scene.run(backend, ForwardMode.DECODE, last)
    assert gathered.count(192) == 1  # the shared whole blocks (3 x 64 of the 200 shared tokens)
    again = scene.run(backend, ForwardMode.DECODE, last)
    assert gathered.count(192) == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    with monkeypatch.context() as mp:  # with nothing kept, the same bits
        mp.setattr(decode_kv, "KEPT_KV_BYTES", 0)
        fresh = scene.run(invariant(scene), ForwardMode.DECODE, last)
    assert all(torch.equal(a, b) for a, b in zip(first, fresh))

    scene.run(backend, ForwardMode.DECODE, last[:1])  # one row: no shared blocks, nothing kept
    assert backend._shared_kv is None
    gathered.clear()
    scene.run(backend, ForwardMode.DECODE, last)
    scene.run(backend, ForwardMode.DECODE, last)
    assert gathered.count(192) == 1

    # an extend ends the reuse: here the shared slots' K/V change with it (as if they had been freed
    # and handed out again), and the next decode must read the new values
    scene.run(backend, ForwardMode.EXTEND, [(0, shared, shared + 10)])
    assert backend._shared_kv is None
    common = scene.table.host[scene.rows[0], :shared]
    for t in (scene.pool.k[0], scene.pool.v[0]):
        t[common] = torch.randn(shared, *t.shape[1:], generator=torch.Generator().manual_seed(1))
    after = scene.run(backend, ForwardMode.DECODE, last)
    want = scene.run(invariant(scene), ForwardMode.DECODE, last)
    assert all(torch.equal(a, b) for a, b in zip(after, want))
    assert not torch.equal(after[1], first[1])

    other = Scene((9, 3, 64), lengths, seed=7, shared=shared)  # the same slots in another pool, other values
    for t in (other.pool.k[0], other.pool.v[0]):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(other.table.host[other.rows[0], :shared], common)
    assert all(torch.equal(a, b) for a, b in zip(other.run(backend, ForwardMode.DECODE, last),
                                                  other.run(invariant(other), ForwardMode.DECODE, last)))


def test_the_shared_gather_kept_is_bounded(monkeypatch):
    lengths = [300, 310]
    scene = Scene((9, 3, 64), lengths, seed=3, shared=256)
    backend = invariant(scene)
    monkeypatch.setattr(decode_kv, "KEPT_KV_BYTES", 100_000)  # under one layer's 2 x 196,608 B
    last = [(r, n - 1, n) for r, n in enumerate(lengths)]
    out = scene.run(backend, ForwardMode.DECODE, last)
    assert backend._shared_kv is not None and backend._shared_kv.layers == {} and backend._shared_kv.nbytes == 0
    assert all(torch.equal(a, b) for a, b in zip(out, scene.run(backend, ForwardMode.DECODE, last)))


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(SHAPES[:4]), data=st.data())
def test_decodes_that_keep_each_rows_keys_give_the_bits_of_decodes_that_gather_them(shape, data):
    """Rows decoding step after step keep their own keys and add each new token's: every step equals
    a backend that gathers everything, through rows leaving and coming back, blocks filling up,
    extends, a shared prefix, and a step whose forward never ran here (one that failed). Slots not
    written yet hold other values, as in a real pool, so a token kept out of step would show."""
    seed = data.draw(st.integers(0, 2**16))
    shared = data.draw(st.sampled_from([0, 0, 70, 130]))
    base = data.draw(st.lists(st.integers(1, 120), min_size=1, max_size=4))
    steps = data.draw(st.integers(1, 70))
    lengths = [shared + b + steps for b in base]
    scene = Scene(shape, lengths, seed, shared=shared)
    truth = scene.pool.k[0].clone(), scene.pool.v[0].clone()
    done = [shared + b for b in base]  # positions written so far, per row
    unwritten = torch.cat([scene.table.host[row, n:lengths[r]] for r, (row, n) in enumerate(zip(scene.rows, done))])
    for t in (scene.pool.k[0], scene.pool.v[0]):
        t[unwritten] = torch.randn(unwritten.numel(), *t.shape[1:], generator=torch.Generator().manual_seed(seed + 1))
    kept = invariant(scene)
    for _ in range(steps):
        event = data.draw(st.sampled_from(["all", "all", "all", "some", "extend", "failed"]))
        rows = list(range(len(base))) if event != "some" else list(range(data.draw(st.integers(1, len(base)))))
        picks = [(r, done[r], done[r] + 1) for r in rows]
        slots = torch.cat([scene.table.host[scene.rows[r], lo:hi] for r, lo, hi in picks])
        for t, want in zip((scene.pool.k[0], scene.pool.v[0]), truth):
            t[slots] = want[slots]  # the step's forward writes its new tokens
        if event == "failed":  # planned, written, never run here: the next step must not use this layer's keys
            kept.init_forward_metadata(_batch(scene, picks, ForwardMode.DECODE))
        else:
            if event == "extend":
                scene.run(kept, ForwardMode.EXTEND, picks[:1])
            got = scene.run(kept, ForwardMode.DECODE, picks)
            want = scene.run(invariant(scene), ForwardMode.DECODE, picks)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        for r in rows:
            done[r] += 1


def test_own_keys_are_gathered_once_per_run_of_decodes_and_dropped_by_an_extend(monkeypatch):
    lengths = [150, 90]
    scene = Scene((9, 3, 64), lengths, seed=5)
    backend = invariant(scene)
    gathered: list[int] = []
    real = decode_kv.gather
    monkeypatch.setattr(decode_kv, "gather", lambda pool, layer, index, rows, kvh, width:
                        gathered.append(rows) or real(pool, layer, index, rows, kvh, width))
    frames = set()
    for n in range(100, 110):  # row 0 from position 99 to 108, row 1 from 79: one block width throughout
        scene.run(backend, ForwardMode.DECODE, [(0, n - 1, n), (1, n - 21, n - 20)])
        frames.add(id(backend._frame))
    assert gathered == [2] and len(frames) == 1  # the run's plans reuse one set of buffers
    scene.run(backend, ForwardMode.EXTEND, [(1, 90 - 1, 90)])
    assert backend._own_kv is None and backend._frame is None  # nothing kept holds the dropped keys
    old = scene.table.host[scene.rows[0], 10:20]  # as if rewritten behind the extend
    for t in (scene.pool.k[0], scene.pool.v[0]):
        t[old] = torch.randn(10, *t.shape[1:], generator=torch.Generator().manual_seed(4))
    got = scene.run(backend, ForwardMode.DECODE, [(0, 109, 110), (1, 89, 90)])
    want = scene.run(invariant(scene), ForwardMode.DECODE, [(0, 109, 110), (1, 89, 90)])
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and gathered == [2, 1, 2, 2]  # the extend gathers too


def test_chunks_of_a_long_prefill_give_the_same_bits(monkeypatch):
    scene = Scene((9, 3, 64), [700], 1)
    backend = invariant(scene)
    whole = scene.run(backend, ForwardMode.EXTEND, [(0, 0, 700)])[0]
    monkeypatch.setattr(invariant_backend, "CHUNK_ELEMS", 9 * 768 * 5)  # 5 queries a chunk
    assert torch.equal(scene.run(backend, ForwardMode.EXTEND, [(0, 0, 700)])[0], whole)


def test_an_extend_gathers_each_requests_keys_once_for_all_its_chunks(monkeypatch):
    """Chunks of one request read ever longer prefixes of its keys: one gather per request and layer
    serves them all, and the outputs are the bits of each request prefilled alone."""
    scene = Scene((9, 3, 64), [300, 200], 2)
    backend = invariant(scene)
    alone = [scene.run(backend, ForwardMode.EXTEND, [(r, 0, n)])[0] for r, n in ((0, 300), (1, 200))]
    # request 0 gets 40 queries a chunk (8 chunks), request 1 50 (its 100 new tokens in 2 chunks)
    monkeypatch.setattr(invariant_backend, "CHUNK_ELEMS", 9 * 320 * 40)
    widths = []
    real = decode_kv.gather
    monkeypatch.setattr(decode_kv, "gather", lambda pool, layer, index, rows, kvh, width:
                        widths.append(width) or real(pool, layer, index, rows, kvh, width))
    both = scene.run(backend, ForwardMode.EXTEND, [(0, 0, 300), (1, 100, 200)])
    assert torch.equal(both[0], alone[0]) and torch.equal(both[1], alone[1][100:])
    assert widths == [320, 256]  # each request's keys up to its last chunk, once


def test_the_torch_backend_is_not_invariant_which_is_why_this_one_exists():
    """Rows sharing a prefix decode through the cascade (the prefix scored once, merged with each row's
    own keys), a row alone through one pass: the bits differ on every CPU. Padding alone need not
    change them (SDPA's CPU kernel gives equal bits for a row padded or not on some CPUs)."""
    lengths = [137, 290, 85, 160]
    scene = Scene((9, 3, 64), lengths, 3, shared=64)
    last = [(r, n - 1, n) for r, n in enumerate(lengths)]
    together = scene.run(TorchAttentionBackend(9, 3, 64), ForwardMode.DECODE, last)
    alone = [scene.run(TorchAttentionBackend(9, 3, 64), ForwardMode.DECODE, [p])[0] for p in last]
    assert any(not torch.equal(a, b) for a, b in zip(alone, together))


def test_auto_picks_it_where_answers_must_not_depend_on_the_batch():
    assert resolve_backend_name("auto", "cpu", invariant=True) == "invariant"
    assert resolve_backend_name("auto", "cpu") == "torch"
    assert resolve_backend_name("torch", "cpu", invariant=True) == "torch"  # an explicit choice stands
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend_name("auto", "cuda", invariant=True)


@pytest.mark.slow
def test_deterministic_inference_in_float32_batch_equals_alone(make_tiny_model):
    """--enable-deterministic-inference: bitwise equal logprobs for a prompt alone and in a batch of
    prompts of other lengths (cold and warm), and the same greedy text as the torch backend."""
    from radixlm.runtime import Engine

    folder = make_tiny_model(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    prompts = ["The cat sat on the mat and", "1, 2, 3,", "A long time ago in a galaxy far, far away there", "Hi"]
    params = {"temperature": 0, "max_new_tokens": 12}
    kw = dict(return_logprob=True, logprob_start_len=0)
    with Engine(model=str(folder), enable_deterministic_inference=True, log_level="warning") as e:
        assert e.runner.attn_backend.name == "invariant"
        alone = []
        for p in prompts:
            e.flush_cache()
            alone.append(e.generate(p, params, **kw)["meta_info"])
        e.flush_cache()
        for _ in range(2):  # cold, then warm
            together = [o["meta_info"] for o in e.generate(prompts, params, **kw)]
            for a, b in zip(alone, together):
                assert a["output_token_logprobs"] == b["output_token_logprobs"]
        assert e.get_server_info()["kv_check"] == "ok"
    with Engine(model=str(folder), log_level="warning") as e:
        assert e.runner.attn_backend.name == "torch"
        ref = e.generate(prompts, params, **kw)
    for a, b in zip(alone, ref):
        assert [t[1] for t in a["output_token_logprobs"]] == [t[1] for t in b["meta_info"]["output_token_logprobs"]]
