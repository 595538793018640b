"""Sampler: greedy, filters, penalties, grammar masks, seeds, logprobs, and the sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.sampling import kernels as sampler
from radixlm.runtime.sampling import penalties
from radixlm.runtime.sampling.kernels import SamplingBatch, compute_logprobs, sample, top_logprobs

CPU = torch.device("cpu")


def make_batch(params, prompts=None, outputs=None, vocab=None, logits=None, seed=0):
    rows = len(params)
    vocab = vocab if vocab is not None else logits.shape[1]
    prompts = prompts if prompts is not None else [[] for _ in range(rows)]
    outputs = outputs if outputs is not None else [[] for _ in range(rows)]
    return SamplingBatch.build(
        params, prompts, outputs, vocab, CPU, generator=torch.Generator().manual_seed(seed)
    )


def draw_many(logits_row, params, n, mask_row=None, seed=0):
    """n independent draws for one row, as one batch of n identical rows."""
    logits = logits_row.unsqueeze(0).expand(n, -1).contiguous()
    mask = None if mask_row is None else mask_row.unsqueeze(0).expand(n, -1).contiguous()
    batch = make_batch([params] * n, logits=logits, seed=seed)
    return sample(logits, batch, mask).next_token_ids


def log_probs(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


# ---------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("vocab", [50, 4096])  # 4096 takes the chunked CPU argmax
def test_greedy_forms_equal_argmax(vocab):
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(1)) * 3
    expected = logits.argmax(dim=-1)
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-6, top_p=0.5),
        SamplingParams(temperature=1.3, top_k=1),
    ):
        out = sample(logits, make_batch([params] * 16, logits=logits))
        assert torch.equal(out.next_token_ids, expected)
        assert out.next_token_ids.dtype == torch.int64


@pytest.mark.parametrize("vocab", [40, 2048])
def test_greedy_ties_take_the_lowest_token_id(vocab):
    logits = torch.zeros(3, vocab)
    logits[0, [vocab - 1, 7, 300 % vocab]] = 5.0
    logits[1, [vocab // 2, vocab - 1]] = 5.0
    # row 2: all equal -> token 0
    out = sample(logits, make_batch([SamplingParams(temperature=0)] * 3, logits=logits))
    assert out.next_token_ids.tolist() == [7, vocab // 2, 0]
    assert torch.equal(out.next_token_ids, logits.argmax(dim=-1))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), chunks=st.integers(8, 40), levels=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_chunked_argmax_equals_argmax_with_many_ties(rows, chunks, levels, seed):
    """Few distinct values: ties inside a chunk and across chunks; -inf rows of a mask too. Vocabularies
    of `chunks` x 128 logits take every chunk size (512 when `chunks` is a multiple of 4, ...)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, chunks * 128), generator=gen).float()
    assert sampler._argmax_chunk(logits.shape[1]) in sampler._ARGMAX_CHUNKS
    logits[0, : logits.shape[1] // 2] = float("-inf")
    assert torch.equal(sampler._argmax(logits), logits.argmax(dim=-1))


def test_logits_are_not_modified():
    logits = torch.randn(4, 64)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.5),
        SamplingParams(temperature=0.5, top_p=0.5, frequency_penalty=1.0),
        SamplingParams(),
        SamplingParams(top_k=3, presence_penalty=1.0),
    ]
    batch = make_batch(params, outputs=[[1, 2], [3, 3], [4], [5]], logits=logits)
    sample(logits, batch, torch.rand(4, 64) > 0.3)
    assert torch.equal(logits, before)


def test_all_greedy_batch_builds_no_generator(monkeypatch):
    logits = torch.randn(4, 32)
    batch = make_batch([SamplingParams(temperature=0, sampling_seed=s) for s in range(4)], logits=logits)

    def forbidden(*args, **kwargs):
        raise AssertionError("a greedy batch must not create generators")

    monkeypatch.setattr(torch, "Generator", forbidden)
    assert torch.equal(sample(logits, batch).next_token_ids, logits.argmax(dim=-1))


# ----------------------------------------------------------------------------------------- seeds


def test_same_seed_same_draws_whatever_the_batch():
    vocab = 4096  # wide and flat: the top_p nucleus exceeds the CPU candidate set
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=gen) * 2
    others = torch.randn(5, vocab, generator=gen) * 2
    mine = SamplingParams(temperature=0.9, top_p=0.9, min_p=0.01, sampling_seed=1234)
    neighbours = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=20),
        SamplingParams(temperature=0.7, sampling_seed=99),
        SamplingParams(top_p=0.5, repetition_penalty=1.3),
        SamplingParams(),
    ]
    alone, inside, split = [], [], []
    for step in range(12):
        history = list(range(step))
        out = sample(
            row.unsqueeze(0), make_batch([mine], outputs=[history], logits=row.unsqueeze(0), seed=step)
        )
        alone.append(out.next_token_ids.item())

        logits = torch.cat([others[:3], row.unsqueeze(0), others[3:]])
        params = neighbours[:3] + [mine] + neighbours[3:]
        outputs = [[1, 2]] * 3 + [history] + [[5]] * 2
        batch = make_batch(params, outputs=outputs, logits=logits, seed=100 + step)
        inside.append(sample(logits, batch).next_token_ids[3].item())

        logits = torch.stack([row, others[0]])
        wide = SamplingParams(top_k=1500, top_p=0.9)  # a wider first candidate set
        batch = make_batch([mine, wide], outputs=[history, [3]], logits=logits, seed=7)
        split.append(sample(logits, batch).next_token_ids[0].item())
    assert alone == inside == split
    assert len(set(alone)) > 1  # the step enters the seed: draws move on


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform
    draws = []
    for seed in range(20):
        seq = [
            sample(
                logits, make_batch([SamplingParams(sampling_seed=seed)], outputs=[[0] * step], logits=logits)
            ).next_token_ids.item()
            for step in range(10)
        ]
        draws.append(tuple(seq))
    assert len(set(draws)) == 20


def test_unseeded_rows_follow_the_shared_generator():
    logits = torch.zeros(8, 1000)
    params = [SamplingParams()] * 8
    first = sample(logits, make_batch(params, logits=logits, seed=5)).next_token_ids
    again = sample(logits, make_batch(params, logits=logits, seed=5)).next_token_ids
    other = sample(logits, make_batch(params, logits=logits, seed=6)).next_token_ids
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# --------------------------------------------------------------------------------------- filters


def test_top_k_never_leaves_the_top_k():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(4))
    allowed = set(logits.topk(5).indices.tolist())
    drawn = set(draw_many(logits, SamplingParams(temperature=2.0, top_k=5), 3000).tolist())
    assert drawn == allowed


def test_top_p_keeps_the_nucleus():
    logits = log_probs([0.05, 0.5, 0.15, 0.3])
    ids = draw_many(logits, SamplingParams(top_p=0.75), 4000)
    assert set(ids.tolist()) == {1, 3}
    share = (ids == 1).float().mean().item()
    assert abs(share - 0.5 / 0.8) < 0.04


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    logits = log_probs([0.1, 0.2, 0.3, 0.4])
    # top_k=2 -> {3: 4/7, 2: 3/7}; top_p=0.5 of that is token 3 alone (without renormalizing, 2 as well).
    ids = draw_many(logits, SamplingParams(top_k=2, top_p=0.5), 500)
    assert set(ids.tolist()) == {3}


def test_min_p_drops_unlikely_tokens():
    logits = log_probs([0.5, 0.3, 0.15, 0.05])  # min_p 0.2 -> keep p >= 0.1
    ids = draw_many(logits, SamplingParams(min_p=0.2), 3000)
    assert set(ids.tolist()) == {0, 1, 2}


def reference_threshold(probs, top_k, top_p):
    values = probs.sort(descending=True).values
    kept = values[:top_k] if top_k > 0 else values
    cums = kept.cumsum(0)
    last = int((cums < top_p * (cums[-1] if top_k > 0 else 1.0)).sum())
    t_p = kept[min(last, len(kept) - 1)].item() if top_p < 1 else 0.0
    return max(kept[-1].item() if top_k > 0 else 0.0, t_p)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
def test_filter_thresholds_match_a_full_sort(scale):
    vocab = 3000
    gen = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, vocab, generator=gen) * scale
    logits[0, :50] = logits[0, 50]  # ties across the boundary
    settings_ = [(-1, 0.9), (40, 1.0), (40, 0.6), (2000, 0.95), (-1, 0.3), (3, 0.99)]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings_]
    batch = make_batch(params, logits=logits)
    probs = torch.softmax(logits, dim=-1)
    got = sampler._sorted_threshold(probs, batch)
    for row, (k, p) in enumerate(settings_):
        assert got[row].item() == pytest.approx(reference_threshold(probs[row], k, p), rel=1e-6)


# ------------------------------------------------------------------------------------- penalties


def greedy_pick(logits_row, params, prompt=(), output=()):
    params = SamplingParams(**{**params, "temperature": 0})
    batch = make_batch(
        [params], prompts=[list(prompt)], outputs=[list(output)], logits=logits_row.unsqueeze(0)
    )
    return sample(logits_row.unsqueeze(0), batch).next_token_ids.item()


@pytest.mark.parametrize(
    "penalty, prompt, output, expected",
    [
        ({}, [0], [0, 0], 0),
        ({"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}, [0], [0, 0], 0),
        ({"repetition_penalty": 1.2}, [0], [], 1),  # 2.0 / 1.2 < 1.9, prompt counts
        ({"repetition_penalty": 1.2}, [], [0], 1),
        ({"repetition_penalty": 1.2}, [5], [], 0),
        ({"frequency_penalty": 0.5}, [0, 0, 0], [], 0),  # frequency ignores the prompt
        ({"frequency_penalty": 0.5}, [], [0], 1),
        ({"presence_penalty": 0.5}, [], [0], 1),
        ({"presence_penalty": 0.5}, [0], [], 0),
    ],
)
def test_penalties_move_the_argmax(penalty, prompt, output, expected):
    logits = torch.tensor([2.0, 1.9, -1.0, 0.5, 0.0, 0.1])
    assert greedy_pick(logits, penalty, prompt, output) == expected


def test_frequency_counts_and_repetition_on_negative_logits():
    logits = torch.tensor([2.0, 1.2, -3.0, -3.5])
    assert greedy_pick(logits, {"frequency_penalty": 0.5}, output=[0]) == 0  # 1.5 > 1.2
    assert greedy_pick(logits, {"frequency_penalty": 0.5}, output=[0, 0]) == 1  # 1.0 < 1.2
    assert greedy_pick(logits, {"presence_penalty": 0.5}, output=[0, 0]) == 0  # once: 1.5 > 1.2
    # repetition divides once however often the token was seen: 2.0 / 1.2 > 1.5
    assert greedy_pick(torch.tensor([2.0, 1.5]), {"repetition_penalty": 1.2}, [0], [0, 0]) == 0
    # negative logits are multiplied: -3.0 * 1.5 = -4.5 < -3.5
    drop = torch.tensor([True, True, False, False])
    logits2 = torch.where(drop, torch.tensor(-1e9), logits)
    assert greedy_pick(logits2, {"repetition_penalty": 1.5}, output=[2]) == 3
    assert greedy_pick(logits2, {}, output=[2]) == 2


def test_penalties_use_their_own_rows_settings():
    logits = torch.tensor([[2.0, 1.5, 0.0]] * 6)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.5),  # 1.33 < 1.5
        SamplingParams(temperature=0, repetition_penalty=1.1),  # 1.82 > 1.5
        SamplingParams(temperature=0, presence_penalty=1.0),  # 1.0 < 1.5
        SamplingParams(temperature=0, frequency_penalty=0.4),  # 1.6 > 1.5
        SamplingParams(temperature=0),
    ]
    batch = make_batch(params, outputs=[[0]] * 6, logits=logits)
    assert sample(logits, batch).next_token_ids.tolist() == [0, 1, 0, 1, 0, 0]


# ----------------------------------------------------------------------------------------- masks


def test_mask_is_respected_by_every_method():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(64, generator=gen) * 2
    mask = torch.zeros(64, dtype=torch.bool)
    mask[[3, 17, 40, 41]] = True
    logits[[5, 6, 7]] += 20.0  # the favourites are all forbidden
    allowed = {3, 17, 40, 41}
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(top_k=1),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.1),
        SamplingParams(min_p=0.5),
        SamplingParams(temperature=5.0),
        SamplingParams(frequency_penalty=-2.0, presence_penalty=-2.0),  # pushes token 5 further up
        SamplingParams(temperature=0, repetition_penalty=0.1),
    ):
        n = 1 if params.greedy else 500
        logits_n = logits.unsqueeze(0).expand(n, -1).contiguous()
        batch = make_batch([params] * n, outputs=[[5, 5, 9]] * n, logits=logits_n)
        ids = sample(logits_n, batch, mask.unsqueeze(0).expand(n, -1)).next_token_ids
        assert set(ids.tolist()) <= allowed, params
    greedy = draw_many(logits, SamplingParams(temperature=0), 1, mask)
    assert greedy.item() == max(allowed, key=lambda t: logits[t].item())


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 6),
    vocab=st.integers(2, 40),
)
def test_random_batches_stay_inside_mask_and_top_k(data, rows, vocab):
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * data.draw(st.sampled_from([0.1, 1.0, 10.0]))
    mask = torch.rand(rows, vocab, generator=gen) < 0.5
    mask[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = True
    params = [
        SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
            top_k=data.draw(st.sampled_from([-1, 1, 2, 5])),
            top_p=data.draw(st.sampled_from([1.0, 0.9, 0.3])),
            min_p=data.draw(st.sampled_from([0.0, 0.1, 0.9])),
            frequency_penalty=data.draw(st.sampled_from([0.0, -2.0, 1.0])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 0.5, 1.5])),
            sampling_seed=data.draw(st.sampled_from([None, 3])),
        )
        for _ in range(rows)
    ]
    outputs = [torch.randint(vocab, (3,), generator=gen).tolist() for _ in range(rows)]
    batch = make_batch(params, outputs=outputs, logits=logits, seed=seed)
    out = sample(logits, batch, mask)
    for row, token in enumerate(out.next_token_ids.tolist()):
        assert mask[row, token]
        k = params[row].top_k
        if k > 0:
            # at most k-1 allowed tokens may beat it once penalties are in (ties share a rank)
            penalized = logits.clone()
            penalties.apply_penalties_(penalized, batch)
            penalized = penalized[row]
            better = ((penalized > penalized[token]) & mask[row]).sum().item()
            assert better < k


# -------------------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_the_chosen_token():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 30, generator=gen)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0.3, top_k=3),
        SamplingParams(temperature=1.5, frequency_penalty=1.0),
        SamplingParams(top_p=0.5),
    ]
    mask = torch.rand(4, 30, generator=gen) < 0.6
    mask[:, 0] = True
    batch = make_batch(params, outputs=[[1, 2, 3]] * 4, logits=logits)
    out = sample(logits.to(torch.bfloat16), batch, mask)
    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    assert out.logprobs.dtype == torch.float32
    expected = raw.gather(1, out.next_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, expected)
    assert out.top_logprobs is None


def test_top_logprobs_sorted_and_of_the_asked_length():
    logits = torch.randn(3, 50)
    batch = make_batch([SamplingParams(temperature=0)] * 3, logits=logits)
    out = sample(logits, batch, top_logprobs_nums=[5, 0, 2])
    assert [len(r) for r in out.top_logprobs] == [5, 0, 2]
    raw = torch.log_softmax(logits, dim=-1)
    for row, entries in enumerate(out.top_logprobs):
        values = [v for v, _ in entries]
        assert values == sorted(values, reverse=True)
        for value, token in entries:
            assert value == pytest.approx(raw[row, token].item(), abs=1e-6)
        if entries:
            assert entries[0][1] == out.next_token_ids[row].item()
    assert sample(logits, batch, top_logprobs_nums=[0, 0, 0]).top_logprobs is None
    helper = top_logprobs(logits, 4)
    assert [[t for _, t in r] for r in helper] == raw.topk(4).indices.tolist()


def test_compute_logprobs_matches_log_softmax_in_chunks():
    logits = torch.randn(10, 40).to(torch.bfloat16)
    ids = torch.randint(40, (10,))
    expected = torch.log_softmax(logits.float(), dim=-1)[torch.arange(10), ids]
    torch.testing.assert_close(compute_logprobs(logits, ids, chunk_rows=3), expected)


# ---------------------------------------------------------------------------------- distribution


def chi_square(ids, probs):
    n = len(ids)
    counts = torch.bincount(ids, minlength=len(probs)).double()
    expected = probs.double() * n
    return ((counts - expected) ** 2 / expected).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7, 1.3])
    probs = torch.softmax(logits / temperature, dim=-1)
    ids = draw_many(logits, SamplingParams(temperature=temperature), 4000, seed=11)
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001
    assert chi_square(ids, probs) < 24.3


def test_seeded_rows_are_distributed_like_softmax():
    logits = torch.tensor([0.5, -0.3, 1.1, 0.0, -1.0, 0.8])
    probs = torch.softmax(logits, dim=-1)
    n = 3000
    params = [SamplingParams(sampling_seed=s) for s in range(n)]
    batch = make_batch(params, logits=logits.expand(n, -1))
    ids = sample(logits.expand(n, -1).contiguous(), batch).next_token_ids
    assert chi_square(ids, probs) < 20.5  # 5 dof, p = 0.001


# ------------------------------------------------------------------------------------ validation


def test_bad_shapes_are_value_errors():
    with pytest.raises(ValueError, match="differ in length"):
        SamplingBatch.build([SamplingParams()], [[1], [2]], [[]], 10, CPU)
    batch = make_batch([SamplingParams()] * 2, vocab=10)
    with pytest.raises(ValueError, match="logits shape"):
        sample(torch.zeros(2, 11), batch)
    with pytest.raises(ValueError, match="vocab_mask shape"):
        sample(torch.zeros(2, 10), batch, torch.ones(2, 9, dtype=torch.bool))
    assert math.isfinite(sample(torch.zeros(2, 10), batch).logprobs.sum().item())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=6), st.integers(0, 3), st.booleans())
def test_logprobs_only_for_the_rows_that_want_them(wants, k, penalized):
    """A row that asks for no logprobs costs no log_softmax; the rows that ask get exactly what a
    whole-batch computation gives them, and the chosen ids never change."""
    n = len(wants)
    logits = torch.randn(n, 300, generator=torch.Generator().manual_seed(n + k)) * 2
    params = [SamplingParams(temperature=0 if i % 2 else 0.7, sampling_seed=i, repetition_penalty=1.3 if penalized
                             else 1.0) for i in range(n)]  # greedy and sampled rows (both code paths)
    batch = make_batch(params, prompts=[[1, 2, 3]] * n, logits=logits)
    tops = [k if w else 0 for w in wants]
    full = sample(logits, batch, None, tops)
    rows = [i for i, w in enumerate(wants) if w]
    part = sample(logits, batch, None, tops, logprob_rows=rows)
    assert torch.equal(full.next_token_ids, part.next_token_ids)
    if not rows:
        assert part.logprobs is None and part.top_logprobs is None
        return
    assert torch.equal(part.logprobs[rows], full.logprobs[rows])
    assert torch.isnan(part.logprobs[[i for i in range(n) if not wants[i]]]).all()
    if k:
        assert part.top_logprobs == [full.top_logprobs[i] if wants[i] else [] for i in range(n)]


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 30), max_size=12), min_size=1, max_size=4),
    steps=st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.lists(st.integers(0, 30), min_size=1, max_size=4)),
                   max_size=12),
)
def test_running_token_history_gives_the_rescanned_penalties(prompts, steps):
    """Penalties from the per-request running counts equal those from rescanning the history, as
    tokens are appended one or several at a time and the last one is rewritten (jump-forward)."""
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
              for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    histories = [penalties.TokenHistory() for _ in prompts]
    for row, rewrite, tokens in steps:
        out = outputs[row % len(prompts)]
        if rewrite and out:
            out[-1:] = tokens  # what jump-forward's retokenization does
        else:
            out += tokens
        kept = SamplingBatch.build(params, prompts, outputs, 32, CPU, histories=histories)
        fresh = SamplingBatch.build(params, prompts, outputs, 32, CPU)
        for name in ("repetition", "frequency"):
            index, value = (f"{name}_index", "repetition_factor" if name == "repetition" else "frequency_delta")
            got = dict(zip(getattr(kept, index).tolist(), getattr(kept, value).tolist()))
            want = dict(zip(getattr(fresh, index).tolist(), getattr(fresh, value).tolist()))
            assert got == pytest.approx(want), name


@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_a_sampled_row_without_mass_draws_an_id_in_range_and_the_others_as_alone(bad):
    """A row whose logits are all -inf or NaN (a broken forward) has no distribution to draw from; its id
    must still be a token (the next step embeds it for the whole batch), and the other rows draw what
    they draw without it."""
    vocab = 7
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[1] = bad
    params = [SamplingParams(temperature=0.8, sampling_seed=i) for i in range(3)]
    got = sample(logits, make_batch(params, logits=logits), logprob_rows=[]).next_token_ids
    assert 0 <= int(got[1]) < vocab
    for i in (0, 2):
        alone = sample(logits[i : i + 1], make_batch(params[i : i + 1], logits=logits[i : i + 1]), logprob_rows=[])
        assert int(got[i]) == int(alone.next_token_ids[0])
