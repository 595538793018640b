"""SamplingParams: liberal about names (every SGLang name, nulls), strict about values (typed errors
naming the field, 64-bit bounds), and the sparse logit_bias / min_new_tokens adjustments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.params import IGNORED_FIELDS, SamplingParams
from radixlm.runtime.sampling.kernels import SamplingBatch, sample

# What sglang.lang's RuntimeEndpoint sends in every request (PyPI sglang 0.5.x), mostly nulls.
SGLANG_FRONTEND = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 16,
    "min_new_tokens": None, "n": None, "stop": [], "stop_token_ids": None, "stop_regex": None,
    "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None,
}


def test_sglang_frontend_body_is_accepted():
    p = SamplingParams.from_dict(SGLANG_FRONTEND)
    assert p.max_new_tokens == 16 and p.min_new_tokens == 0 and p.stop == [] and p.stop_regex == []
    assert p.constraint is None and p.greedy


def test_every_sglang_name_accepted_at_its_null_value():
    names = ["stream_interval", "custom_params", "beam_width", "watermark", *IGNORED_FIELDS]
    p = SamplingParams.from_dict(dict.fromkeys(names))
    assert p == SamplingParams()
    assert SamplingParams.from_dict({"beam_width": 1, "stream_interval": 4, "spaces_between_special_tokens": False})


@pytest.mark.parametrize("data, field", [
    ({"temprature": 0.5}, "temprature"),
    ({"beam_width": 4}, "beam_width"),
    ({"sampling_seed": 2**70}, "sampling_seed"),
    ({"max_new_tokens": 2**64}, "max_new_tokens"),
    ({"top_k": 2**63}, "top_k"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
    ({"stop_regex": "(unclosed"}, "stop_regex"),
    ({"stop_regex": ["a"] * 17}, "stop_regex"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"regex": "a", "json_schema": "{}"}, "json_schema"),
])
def test_bad_values_are_typed_errors_naming_the_field(data, field):
    with pytest.raises(RequestError) as e:
        SamplingParams.from_dict(data)
    assert e.value.field == field and e.value.section == "sampling_params" and e.value.status == 400
    assert str(e.value).startswith(field)


def test_seed_is_any_64_bit_pattern_and_logit_bias_keys_become_ids():
    assert SamplingParams(sampling_seed=-1).sampling_seed == 2**64 - 1
    assert SamplingParams(sampling_seed=2**64 - 1).sampling_seed == 2**64 - 1
    p = SamplingParams.from_dict({"logit_bias": {"42": -100, 7: 2.5}})
    assert p.logit_bias == {42: -100.0, 7: 2.5}
    assert SamplingParams.from_dict({"stop_regex": r"\d+"}).stop_regex == [r"\d+"]


@settings(max_examples=examples(200), deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(SGLANG_FRONTEND) + ["logit_bias", "sampling_seed", "bogus"]),
                       st.one_of(st.none(), st.integers(-(2**80), 2**80), st.floats(allow_nan=True),
                                 st.text(max_size=5), st.booleans(), st.lists(st.integers(-3, 2**70), max_size=3),
                                 st.dictionaries(st.text(max_size=3), st.integers(-200, 200), max_size=2))))
def test_any_body_is_params_or_a_typed_error(data):
    """Whatever a client sends: valid params, or a RequestError naming a field it sent."""
    try:
        p = SamplingParams.from_dict(data)
    except RequestError as e:
        assert e.field in data
        return
    assert 0 <= p.max_new_tokens < 2**63 and (p.sampling_seed is None or 0 <= p.sampling_seed < 2**64)


# ------------------------------------------------------------------------ sampler adjustments
def _batch(params, outputs, vocab, eos=(0,)):
    return SamplingBatch.build(params, [[] for _ in params], outputs, vocab, torch.device("cpu"), eos_ids=eos)


def test_logit_bias_moves_the_greedy_choice_per_row():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 5.0
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={4: -100}),
              SamplingParams(temperature=0, logit_bias={9: 6})]
    out = sample(logits, _batch(params, [[], [], []], 10))
    assert out.next_token_ids.tolist() == [4, 0, 9]
    assert torch.equal(logits[:, 4], torch.full((3,), 5.0)), "the caller's logits are not modified"


def test_min_new_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, 10)
    logits[:, 0] = 9.0  # EOS is the favourite
    logits[:, 3] = 8.0  # then a stop token id
    p = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[3])
    grammar = SamplingParams(temperature=0, min_new_tokens=2, regex="a")  # left to its grammar
    out = sample(logits, _batch([p, p, p, grammar], [[], [5], [5, 5], []], 10))
    assert out.next_token_ids.tolist() == [1, 1, 0, 0]
    assert out.logprobs[0].item() < 0 and torch.isfinite(out.logprobs).all(), "logprobs stay the raw model's"
