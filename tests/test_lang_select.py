"""radixlm.lang's select against the fake Engine of tests/test_lang.py: the choices scored in one batched
prefill, and the choice methods (length-normalized, greedy token, unconditional likelihood)."""

from __future__ import annotations

import pytest
from test_lang import FakeEngine

import radixlm.lang as rl


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


# --- select ---------------------------------------------------------------------------------------

def test_select_scores_all_choices_in_one_batched_prefill(fake):
    fake.liked = {"Paris"}
    prefix = "The capital of France is "
    choices = ["London", "Paris", "Rome"]

    @rl.function
    def prog(s):
        s += prefix + rl.select("city", choices=choices) + "."

    state = prog.run(backend=fake)
    assert state["city"] == "Paris"
    assert state.text() == prefix + "Paris."
    head, batch = fake.calls
    assert head["prompt"] == prefix and head["sampling_params"] == {"max_new_tokens": 0}
    assert batch["prompt"] == [prefix + c for c in choices]
    assert [sp["max_new_tokens"] for sp in batch["sampling_params"]] == [0, 0, 0]
    assert batch["return_logprob"] is True
    # "is " + "Paris" tokenizes as "is", " Paris": scoring starts at the prefix's last token
    n_prefix = len(fake.tokenizer.encode(prefix))
    assert batch["logprob_start_len"] == [n_prefix - 1] * 3
    meta = state.get_meta_info("city")
    assert meta["normalized_prompt_logprobs"] == [-2.0, -0.5, -2.0]
    scored = [fake.tokenizer.decode([e[1] for e in lps]) for lps in meta["input_token_logprobs"]]
    assert scored == [" London", " Paris", " Rome"]
    # gen(choices=...) is the same select
    assert prog.run(backend=fake)["city"] == rl.function(
        lambda s: s.__iadd__(prefix + rl.gen("c", choices=choices))).run(backend=fake)["c"]


def test_greedy_token_selection_differs_from_length_normalized(fake):
    table = {"Paris": -0.1, "Texas": -6.0, "Rome": -1.0}
    fake.score = lambda context, token: table[token.strip()]
    choices = ["Paris Texas", "Rome"]

    def pick(method):
        @rl.function
        def prog(s):
            s += "City:" + rl.select("c", choices=[" " + c for c in choices], choices_method=method)

        return prog.run(backend=fake)

    assert pick(rl.token_length_normalized)["c"] == " Rome"  # mean -3.05 vs -1.0
    state = pick(rl.greedy_token_selection)
    assert state["c"] == " Paris Texas"  # first token -0.1 beats -1.0
    assert state.get_meta_info("c")["greedy_logprob_matrix"][1] == [-1.0, -1.0]


def test_unconditional_likelihood_normalized_scores_without_the_prefix():
    fake = FakeEngine(bos=True)
    conditional = {"Paris": -1.0, "Rome": -1.5}
    unconditional = {"Paris": -0.2, "Rome": -3.0}
    fake.score = lambda ctx, token: (conditional if "capital" in ctx else unconditional)[token.strip()]

    def pick(method):
        @rl.function
        def prog(s):
            s += "The capital is" + rl.select("c", choices=[" Paris", " Rome"], choices_method=method)

        return prog.run(backend=fake)

    assert pick(rl.token_length_normalized)["c"] == " Paris"
    fake.calls.clear()
    state = pick(rl.unconditional_likelihood_normalized)
    assert state["c"] == " Rome"  # -1.5 - (-3.0) beats -1.0 - (-0.2)
    meta = state.get_meta_info("c")
    assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.8, 1.5])
    third = fake.calls[2]
    bos = fake.tokenizer.bos_token_id
    assert third["input_ids"] == [[bos, fake.tokenizer.encode(" Paris", False)[0]],
                                  [bos, fake.tokenizer.encode(" Rome", False)[0]]]
