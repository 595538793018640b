"""radixlm.lang against the real in-process Engine on the built-in model (SmolLM2-135M), greedy.

tests/test_lang.py checks what the language sends, against a fake; this file checks that the
primitives do what they promise end to end: stop strings end a gen, select's scores are the
runtime's log-probabilities in the order of the choices, constrained outputs parse, roles render
the model's own chat template byte for byte, streaming pieces add up, fork branches share a
batch and the cached prefix, run_batch keeps order and isolates failures. The last test runs a
program through a live server (RuntimeEndpoint) and checks it gives the Engine's results.
tests/test_lang_engine_meta_info.py checks what a gen's options put in its meta info, async
streaming, and flush_cache / get_server_info.
"""

from __future__ import annotations

import json
import re

import pytest

import radixlm.lang as rl

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}


@pytest.fixture
def backend(engine):
    """The shared Engine, as the language wraps it (the same wrapper every time)."""
    return rl.as_backend(engine)


def forward_passes(engine) -> int:
    return engine.get_server_info()["forward_passes"]


# --- gen ------------------------------------------------------------------------------------------

def test_stop_string_ends_gen_and_is_trimmed(engine):
    @rl.function
    def days(s, stop_at):
        s += "The days of the week are Monday, Tuesday, Wednesday"
        s += rl.gen("rest", max_tokens=12, stop=stop_at)

    free = days.run(stop_at=None, backend=engine, **GREEDY)
    assert "," in free["rest"][1:], f"the continuation has no comma to stop at: {free['rest']!r}"
    cut = days.run(stop_at=[","], backend=engine, **GREEDY)
    assert cut["rest"] == free["rest"].split(",")[0]
    meta = cut.get_meta_info("rest")
    assert meta["finish_reason"] == {"type": "stop", "matched": ","}
    assert meta["completion_tokens"] < free.get_meta_info("rest")["completion_tokens"]
    assert cut.text().endswith(cut["rest"]) and not cut.text().endswith(",")


def test_gen_in_assistant_role_stops_at_end_of_turn(engine):
    @rl.function
    def chat(s):
        s += rl.user("Say hello.")
        s += rl.assistant(rl.gen("reply", max_tokens=40))

    state = chat.run(backend=engine, **GREEDY)
    meta = state.get_meta_info("reply")
    assert meta["finish_reason"]["type"] == "stop", meta
    assert "<|im_end|>" not in state["reply"] and state["reply"].strip()


# --- select ---------------------------------------------------------------------------------------

SKY = "Q: What color is the sky on a clear day?\nA: The sky is"


def _direct_scores(engine, prefix: str, choices: list[str]) -> list[float]:
    """Mean log-probability of each choice's tokens after `prefix`, asked of the Engine directly."""
    tok = engine.tokenizer
    n_prefix = len(tok(prefix).input_ids)
    scores = []
    for choice in choices:
        ids = tok(prefix + choice).input_ids
        assert ids[:n_prefix] == tok(prefix).input_ids, "choice merged into the prefix's last token"
        out = engine.generate(prompt=prefix + choice, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=n_prefix)
        lps = [e[0] for e in out["meta_info"]["input_token_logprobs"]]
        assert len(lps) == len(ids) - n_prefix
        scores.append(sum(lps) / len(lps))
    return scores


def test_select_returns_a_member_with_scores_in_choice_order(engine):
    @rl.function
    def sky(s, choices):
        s += SKY + rl.select("color", choices)

    choices = [" green", " blue", " bright red"]
    state = sky.run(choices=choices, backend=engine, **GREEDY)
    scores = state.get_meta_info("color")["normalized_prompt_logprobs"]
    assert state["color"] in choices
    assert state["color"] == choices[max(range(3), key=scores.__getitem__)]
    assert state.text() == SKY + state["color"]
    assert scores == pytest.approx(_direct_scores(engine, SKY, choices), abs=2e-3)

    flipped = sky.run(choices=choices[::-1], backend=engine, **GREEDY)
    assert flipped["color"] == state["color"]
    assert flipped.get_meta_info("color")["normalized_prompt_logprobs"] == pytest.approx(scores[::-1], abs=2e-3)


def test_select_handles_a_prefix_ending_in_a_space(engine):
    """"is " + "blue" tokenizes as "is", " blue": the space belongs to the choice's token, so the
    scores must equal those of "is" + " blue"."""

    @rl.function
    def sky(s, prefix, choices):
        s += prefix + rl.select("color", choices)

    joined = sky.run(prefix=SKY, choices=[" green", " blue"], backend=engine, **GREEDY)
    spaced = sky.run(prefix=SKY + " ", choices=["green", "blue"], backend=engine, **GREEDY)
    assert spaced["color"] == joined["color"].strip()
    assert (spaced.get_meta_info("color")["normalized_prompt_logprobs"]
            == pytest.approx(joined.get_meta_info("color")["normalized_prompt_logprobs"], abs=2e-3))


@pytest.mark.parametrize("method", [rl.greedy_token_selection, rl.unconditional_likelihood_normalized],
                         ids=repr)
def test_select_other_methods_return_a_member(engine, method):
    @rl.function
    def sky(s):
        s += SKY + rl.select("color", [" green", " blue", " bright red"], choices_method=method)

    state = sky.run(backend=engine, **GREEDY)
    meta = state.get_meta_info("color")
    assert state["color"] in (" green", " blue", " bright red")
    if method is rl.unconditional_likelihood_normalized:
        scores = meta["normalized_unconditional_prompt_logprobs"]
        assert state["color"] == [" green", " blue", " bright red"][max(range(3), key=scores.__getitem__)]
    else:
        assert len(meta["greedy_logprob_matrix"]) == 3


# --- constrained gen ------------------------------------------------------------------------------

def test_regex_and_dtype_outputs_parse(engine):
    @rl.function
    def facts(s):
        s += "A US phone number: " + rl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=12) + "\n"
        s += "The number of legs of a spider: " + rl.gen_int("legs", max_tokens=6) + "\n"
        s += "Pi is about " + rl.gen("pi", dtype=float, max_tokens=8) + "\n"
        s += "Is water wet? " + rl.gen("wet", dtype=bool, max_tokens=4) + "\n"
        s += "Name a fruit, quoted: " + rl.gen_string("fruit", max_tokens=10)

    state = facts.run(backend=engine, **GREEDY)
    assert state.error() is None
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", state["phone"])
    int(state["legs"])
    float(state["pi"])
    assert state["wet"] in ("True", "False")
    assert isinstance(json.loads(state["fruit"]), str)


def test_json_schema_output_parses_and_matches(engine):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }

    @rl.function
    def person(s):
        s += "Alice is 30 years old. As JSON: " + rl.gen("json", json_schema=schema, max_tokens=40)

    state = person.run(backend=engine, **GREEDY)
    value = json.loads(state["json"])
    assert set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


# --- roles ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_system", [True, False], ids=["system", "no-system"])
def test_roles_render_exactly_the_chat_template(engine, with_system):
    @rl.function
    def chat(s):
        if with_system:
            s += rl.system("You answer in one short sentence.")
        with s.user():
            s += "What is the capital " + "of France?"
        s += rl.assistant(rl.gen("a1", max_tokens=12))
        s.user("And of Italy?")
        with s.assistant():
            s += rl.gen("a2", max_tokens=12)

    state = chat.run(backend=engine, **GREEDY)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system"] * with_system + ["user", "assistant"] * 2
    assert messages[-3]["content"] == state["a1"] and messages[-1]["content"] == state["a2"]
    assert state.text() == engine.apply_chat_template(messages, add_generation_prompt=False)
    # what the first gen saw is the template's own generation prompt, token for token
    opening = engine.apply_chat_template(messages[: 1 + with_system], add_generation_prompt=True)
    assert state.get_meta_info("a1")["prompt_tokens"] == len(engine.tokenizer(opening).input_ids)


# --- streaming ------------------------------------------------------------------------------------

@pytest.mark.parametrize("incremental", [False, True])
def test_stream_pieces_concatenate_to_the_final_value(engine, incremental, monkeypatch):
    # the Engine's chunks carry the text so far, or with incremental_streaming_output the new text only
    monkeypatch.setattr(engine.server_args, "incremental_streaming_output", incremental)

    @rl.function
    def story(s):
        s += "Once upon a time, in a small village,"
        s += rl.gen("story", max_tokens=16, ignore_eos=True)

    streamed = story.run(stream=True, backend=engine, **GREEDY)
    pieces = list(streamed.text_iter("story"))
    assert len(pieces) > 1, "the value came in one piece: not streamed"
    assert "".join(pieces) == streamed["story"]
    assert streamed.text() == "Once upon a time, in a small village," + streamed["story"]
    assert streamed["story"] == story.run(backend=engine, **GREEDY)["story"]


# --- fork / join ----------------------------------------------------------------------------------

TOPIC = ("You are planning a short talk about the benefits of cycling to work. Write one short "
         "point per line, each a single sentence.\n")


def test_fork_branches_share_one_batch_and_the_cached_prefix(engine):
    @rl.function
    def outline(s):
        s += TOPIC
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Point {i + 1}:" + rl.gen("point", max_tokens=8, ignore_eos=True)
        forks.join()

    before = forward_passes(engine)
    state = outline.run(backend=engine, **GREEDY)
    passes = forward_passes(engine) - before
    metas = state.get_meta_info("point")
    assert len(state["point"]) == 3 and all(isinstance(p, str) and p for p in state["point"])
    prefix_tokens = len(engine.tokenizer(TOPIC).input_ids)
    for meta in metas:
        assert meta["cached_tokens"] >= prefix_tokens - 1, meta
    # one at a time, each branch needs 1 prefill + 7 decode passes (24 in all); batched, the
    # branches decode together: 1 prefix prefill + at most 3 branch prefills + 7 decodes
    sequential = sum(m["completion_tokens"] for m in metas)
    assert passes <= 11 < sequential, (passes, sequential)


def test_join_concate_and_append_appends_branch_texts(engine):
    @rl.function
    def pair(s):
        s += "Two fruits:"
        forks = s.fork(2)
        forks += lambda i: f" ({i + 1})" + rl.gen("fruit", max_tokens=3, ignore_eos=True)
        forks.join("concate_and_append")
        return [f["fruit"] for f in forks]

    state = pair.run(backend=engine, **GREEDY)
    a, b = state.ret_value
    assert state.text() == f"Two fruits: (1){a} (2){b}"


# --- run_batch and errors -------------------------------------------------------------------------

@rl.function
def _numbered(s, i):
    if i == 2:
        raise ValueError("user code failed on item 2")
    s += f"Count from {i}: {i},"
    s += rl.gen("next", max_tokens=4, ignore_eos=True)


def test_run_batch_preserves_order_and_reports_per_item_errors(engine):
    states = _numbered.run_batch([{"i": i} for i in range(5)], backend=engine, num_threads=5,
                                 progress_bar=True, **GREEDY)
    assert len(states) == 5
    for i, state in enumerate(states):
        if i == 2:
            assert isinstance(state.error(), ValueError) and "item 2" in str(state.error())
            with pytest.raises(ValueError, match="item 2"):
                state["next"]
        else:
            assert state.error() is None
            assert state.text() == f"Count from {i}: {i}," + state["next"]
            assert state.get_meta_info("next")["completion_tokens"] == 4


def test_exception_in_a_fork_branch_surfaces_on_join_only(engine):
    @rl.function
    def branches(s):
        s += "Colors:"
        forks = s.fork(2)
        forks[0] += " red," + rl.gen("c", max_tokens=2)
        forks[1] += rl.gen("c", max_tokens=2, temperature=-1.0)  # invalid: raises on that branch
        with pytest.raises(ValueError, match="temperature"):
            forks.join()
        forks[0].sync()
        return forks[0].error()

    state = branches.run(backend=engine, **GREEDY)
    assert state.error() is None and state.ret_value is None


def test_bad_regex_fails_only_its_own_state(engine):
    @rl.function
    def prog(s, regex):
        s += "Digits: " + rl.gen("d", max_tokens=4, regex=regex)

    states = prog.run_batch([{"regex": "[0-9]+"}, {"regex": "[0-9"}, {"regex": "[0-9]+"}],
                            backend=engine, **GREEDY)
    assert states[1].error() is not None
    for i in (0, 2):
        assert states[i].error() is None and re.fullmatch("[0-9]+", states[i]["d"])


# --- the same programs over HTTP ------------------------------------------------------------------

@pytest.fixture(scope="module")
def endpoint(smollm_folder, engine):
    from radixlm.server import launch_server

    # the shared engine's mode (float32), so that both give the same numbers
    handle = launch_server(model=str(smollm_folder), port=0, max_total_tokens=8192, log_level="warning",
                           quantization=engine.runner.quantization)
    backend = rl.RuntimeEndpoint(handle.url, tokenizer=engine.tokenizer)
    yield backend
    backend.shutdown()
    handle.shutdown()


@rl.function
def _kitchen_sink(s):
    s += rl.system("You answer briefly.")
    s += rl.user("What color is the sky?")
    s += rl.assistant(rl.gen("answer", max_tokens=10))
    s += "The days are Monday, Tuesday," + rl.gen("days", max_tokens=8, stop=",")
    s += "\nThe sky is" + rl.select("pick", [" blue", " green", " bright red"])
    s += "\nCode: " + rl.gen("code", regex="[0-9]{3}", max_tokens=5)
    forks = s.fork(2)
    for i, branch in enumerate(forks):
        branch += f"\nIdea {i + 1}:" + rl.gen("idea", max_tokens=6, ignore_eos=True)
    forks.join()


def test_runtime_endpoint_gives_the_engine_results(engine, endpoint):
    local = _kitchen_sink.run(backend=engine, **GREEDY)
    remote = _kitchen_sink.run(backend=endpoint, **GREEDY)
    assert local.error() is None and remote.error() is None
    assert remote.text() == local.text() and remote.messages() == local.messages()
    for name in ("answer", "days", "pick", "code", "idea"):
        assert remote[name] == local[name], name
    assert (remote.get_meta_info("pick")["normalized_prompt_logprobs"]
            == pytest.approx(local.get_meta_info("pick")["normalized_prompt_logprobs"], abs=2e-3))
    assert re.fullmatch("[0-9]{3}", remote["code"])
    assert all(meta["cached_tokens"] > 0 for meta in remote.get_meta_info("idea"))

    @rl.function
    def story(s):
        s += "Once upon a time," + rl.gen("x", max_tokens=8, ignore_eos=True)

    pieces = list(story.run(backend=endpoint, stream=True, **GREEDY).text_iter("x"))
    assert len(pieces) > 1 and "".join(pieces) == story.run(backend=engine, **GREEDY)["x"]
