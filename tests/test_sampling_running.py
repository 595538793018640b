"""The sampling state kept with the running batch: filtered and merged, it equals a fresh build."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.request.req import Req
from radixlm.runtime.sampling.kernels import SamplingBatch, sample
from radixlm.runtime.sampling.running import RunningSampling, update_rows

VOCAB = 3000  # above the top-p candidate count, so sort widths differ between rows
CPU = torch.device("cpu")


def build(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.build(params, [[1, 2]] * len(params), [[3] * 4] * len(params), VOCAB, CPU)


def assert_same(got: SamplingBatch, want: SamplingBatch) -> None:
    for f in dataclasses.fields(SamplingBatch):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor) or isinstance(a, torch.Tensor):
            assert a is not None and b is not None, f.name
            assert a.dtype == b.dtype and torch.equal(a, b), f.name
        else:
            assert a == b, f.name


step_invariant_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.3]),
    top_k=st.sampled_from([-1, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    min_p=st.sampled_from([0.0, 0.1]),
    min_new_tokens=st.integers(0, 4),  # every row has 4 output tokens: reached
    logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB + 5), st.floats(-100, 100), max_size=3)),
)


@settings(max_examples=examples(150), deadline=None)
@given(rows=st.lists(step_invariant_params, min_size=1, max_size=12), data=st.data())
def test_filter_then_merge_equals_a_fresh_build(rows, data):
    batch = build(rows)
    keep = sorted(data.draw(st.sets(st.integers(0, len(rows) - 1)), label="keep"))
    joined = data.draw(st.lists(step_invariant_params, max_size=5), label="joined")
    filtered = update_rows(batch, keep, [])
    assert_same(filtered, build([rows[i] for i in keep]))
    if joined:
        assert_same(update_rows(filtered, list(range(len(keep))), joined), build([rows[i] for i in keep] + joined))


def test_filtered_batch_draws_what_a_fresh_one_draws():
    params = [SamplingParams(temperature=0.8, top_k=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_p=0.5, logit_bias={4: 50.0}), SamplingParams(min_p=0.2)]
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    kept = update_rows(build(params), [0, 2, 3], [])
    for batch in (kept, build([params[i] for i in (0, 2, 3)])):
        batch.generator = torch.Generator().manual_seed(5)
        ids = sample(logits, batch).next_token_ids
        if batch is kept:
            first = ids
    assert torch.equal(first, ids)
    assert ids[1] == 4  # the logit_bias moved with its row


def test_rows_that_depend_on_the_step_cannot_be_kept():
    for params in (SamplingParams(temperature=1.0, sampling_seed=3), SamplingParams(repetition_penalty=1.2)):
        with pytest.raises(ValueError, match="step-invariant"):
            update_rows(build([params]), [0], [])


def req(rid: str, **params) -> Req:
    return Req(rid=rid, input_ids=[1, 2, 3], params=SamplingParams(**params))


def test_running_sampling_reuses_filters_and_merges():
    state = RunningSampling(VOCAB, CPU, eos_ids=[0])
    a, b, c, d = req("a"), req("b", temperature=0.7, top_k=9), req("c", top_p=0.8), req("d", temperature=0.0)
    first = state.for_rows([a, b, c])
    assert state.for_rows([a, b, c]) is first and state.reused == 1
    assert_same(state.for_rows([a, c]), build([a.params, c.params]))  # b finished
    assert state.filtered == 1
    assert_same(state.for_rows([a, c, d]), build([a.params, c.params, d.params]))  # d admitted
    assert state.merged == 1
    assert_same(state.for_rows([c, a]), build([c.params, a.params]))  # reordered: built again
    assert state.built == 2
    seeded = req("e", temperature=0.9, sampling_seed=1)
    assert state.for_rows([c, a, seeded]) is None  # its seed mixes in the step: launch builds it
    short = req("f", min_new_tokens=2)
    assert state.for_rows([short]) is None  # EOS is held back until min_new_tokens
    short.output_ids = [5, 6]
    assert_same(state.for_rows([short]), build([short.params]))


@settings(max_examples=examples(100), deadline=None)
@given(data=st.data())
def test_any_sequence_of_running_batches_samples_as_if_built_fresh(data):
    """Rows leave anywhere, join at the end or anywhere, reorder: whatever the state reuses, filters,
    merges or builds, it equals a fresh build of that step's rows."""
    pool = [Req(rid=str(i), input_ids=[1], params=data.draw(step_invariant_params), output_ids=[7] * 4)
            for i in range(10)]
    state = RunningSampling(VOCAB, CPU, eos_ids=[0])
    rows = data.draw(st.lists(st.sampled_from(pool), min_size=1, unique_by=id), label="first")
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        assert_same(state.for_rows(rows), build([r.params for r in rows]))
        kept = [r for r in rows if data.draw(st.booleans())]
        joined = data.draw(st.lists(st.sampled_from(pool), unique_by=id))
        rows = list({id(r): r for r in kept + joined}.values()) or rows
        if data.draw(st.booleans(), label="shuffle"):
            rows = data.draw(st.permutations(rows))
