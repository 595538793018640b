"""Sampler: greedy, seeds, penalties, logprobs, and bad or degenerate batches.

tests/test_sampler_distribution.py checks what sampled rows may draw: filters, grammar masks and the
sampled distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from sampler_batches import CPU, make_batch, pack

from radixlm.constrained.bitmask import masked_argmax, refused_out
from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.sampling import kernels as sampler
from radixlm.runtime.sampling import penalties
from radixlm.runtime.sampling.kernels import SamplingBatch, compute_logprobs, sample, top_logprobs

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


@settings(max_examples=examples(60), deadline=None)
@given(rows=st.integers(1, 9), chunks=st.integers(8, 40), levels=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_chunked_argmax_equals_argmax_with_many_ties(rows, chunks, levels, seed):
    """Few distinct values: ties inside a chunk and across chunks; -inf rows of a mask too. Vocabularies
    of `chunks` x 128 logits take every chunk size (512 when `chunks` is a multiple of 4, ...)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, chunks * 128), generator=gen).float()
    assert sampler._argmax_chunk(logits.shape[1]) in sampler._ARGMAX_CHUNKS
    logits[0, : logits.shape[1] // 2] = float("-inf")
    assert torch.equal(sampler._argmax(logits), logits.argmax(dim=-1))


@settings(max_examples=examples(80), deadline=None)
@given(rows=st.integers(1, 12), vocab=st.sampled_from([37, 64, 1000, 4096, 4100]), levels=st.integers(2, 6),
       density=st.lists(st.sampled_from([0.0, 0.001, 0.02, 0.5, 0.99, 0.999, 1.0]), min_size=12, max_size=12),
       best_allowed=st.lists(st.booleans(), min_size=12, max_size=12), seed=st.integers(0, 2**31))
def test_greedy_rows_under_a_packed_mask_take_the_masked_argmax(rows, vocab, levels, density, best_allowed, seed):
    """The grammars' packed bitmask on the CPU (each row's best token checked, rows allowing few tokens
    read word by word, rows refusing few knocked out of a copy, the others masked whole) chooses what
    argmax over the bool mask chooses: rows with one allowed token, a handful, most, or all; the
    unmasked best allowed or not; many ties (few distinct values)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    mask = torch.stack([torch.rand(vocab, generator=gen) < density[r] for r in range(rows)])
    mask[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] = True  # never an empty row
    best = logits.argmax(dim=-1)
    mask[torch.arange(rows), best] = torch.tensor(best_allowed[:rows])
    mask[~mask.any(dim=1), 0] = True
    expected = torch.where(mask, logits, float("-inf")).argmax(dim=-1)
    batch = make_batch([SamplingParams(temperature=0)] * rows, logits=logits)
    assert torch.equal(sample(logits, batch, pack(mask)).next_token_ids, expected)
    assert torch.equal(sample(logits, batch, mask).next_token_ids, expected)
    reverse = torch.arange(rows - 1, -1, -1)
    found = masked_argmax(logits.numpy(), pack(mask)[reverse].numpy(), reverse.numpy())
    assert found is not None and found.tolist() == expected[reverse].tolist()
    knocked = refused_out(logits, pack(mask)[reverse].numpy(), reverse.numpy())
    assert torch.equal(knocked, torch.where(mask, logits, float("-inf"))[reverse])


def test_a_packed_mask_serves_sampled_rows_and_logprobs_as_the_bool_one():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 100, generator=gen)
    mask = torch.rand(4, 100, generator=gen) < 0.3
    mask[:, 5] = True
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, sampling_seed=1),
              SamplingParams(temperature=1.0, top_k=5, sampling_seed=2), SamplingParams(temperature=0)]
    outs = [sample(logits, make_batch(params, logits=logits), m, [2] * 4) for m in (mask, pack(mask))]
    assert torch.equal(outs[0].next_token_ids, outs[1].next_token_ids)
    assert torch.equal(outs[0].logprobs, outs[1].logprobs) and outs[0].top_logprobs == outs[1].top_logprobs
    assert bool(mask.gather(1, outs[1].next_token_ids.unsqueeze(1)).all())


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


@settings(max_examples=examples(40), deadline=None)
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


@settings(max_examples=examples(60), deadline=None)
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
