"""SGLang API parity of radixlm.lang, on scripted backends (no model): SGLang-style programs for
gen's signature, dtype regexes and stops, min_tokens, text_async_iter, error(), global_config,
trace / precache, run_batch forms, token_usage, API speculative execution and multimodal."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

import radixlm.lang as rl
from radixlm.lang.backend import Backend, GenOutput
from radixlm.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

# SGLang's values, as its python/sglang/lang/ir.py defines them
SGLANG_REGEX = {"int": r"[-+]?[0-9]+[ \n]*", "float": r"[-+]?[0-9]*\.?[0-9]+[ \n]*", "bool": r"(True|False)",
                "str": r"\"[\w\d\s]*\""}
SGLANG_GEN_ORDER = ["name", "max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
                    "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos",
                    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "dtype",
                    "choices", "choices_method", "regex", "json_schema"]


class Scripted(Backend):
    """Answers each generate with the next scripted text (cut at the request's stop strings, as
    a server does) and records every request."""

    def __init__(self, answers: list[str], stream_pieces: int = 1) -> None:
        super().__init__()
        self.answers, self.requests, self.cached = list(answers), [], []
        self.stream_pieces = stream_pieces

    def apply_chat_template(self, messages, add_generation_prompt=False):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def generate(self, prompt, params):
        self.requests.append({"text": prompt.text, **params.sampling_params()})
        text = self.answers.pop(0)
        cut = min([text.find(s) for s in params.resolve_dtype().stop or [] if s in text], default=-1)
        finish = {"type": "stop"} if cut >= 0 else {"type": "length"}
        return GenOutput(text if cut < 0 else text[:cut], {"finish_reason": finish})

    def generate_stream(self, prompt, params):
        out = self.generate(prompt, params)
        n = max(1, len(out.text) // self.stream_pieces)
        for i in range(0, len(out.text), n):
            yield out.text[i:i + n], {"piece": i}

    def cache_prefix(self, prompt):
        self.cached.append(prompt.text)


def test_dtype_regexes_and_stops_are_sglangs():
    assert (REGEX_INT, REGEX_FLOAT, REGEX_BOOL, REGEX_STR) == tuple(SGLANG_REGEX.values())
    backend = Scripted(["7", "2.5", "True", '"hi"'])

    @rl.function
    def prog(s):
        s += "A week has " + rl.gen_int("i") + " days. " + rl.gen("f", dtype=float) + rl.gen("b", dtype=bool)
        s += rl.gen_string("s")

    state = prog.run(backend=backend, temperature=0)
    assert state["i"] == "7" and state.error() is None
    sent = backend.requests
    assert [r["regex"] for r in sent] == list(SGLANG_REGEX.values())
    assert [r.get("stop") for r in sent] == [[" ", "\n"], [" ", "\n"], None, None]
    assert all("token_healing" not in r and "json_schema" not in r for r in sent)  # off: SGLang's request


def test_gen_signature_and_min_tokens():
    assert list(inspect.signature(rl.gen).parameters)[: len(SGLANG_GEN_ORDER)] == SGLANG_GEN_ORDER
    backend = Scripted(["a b", "c"])

    @rl.function
    def prog(s):
        s += rl.gen("x", 16, 4, None, "\n", None, r"\d+") + rl.gen("y", min_tokens=2, token_healing=True)

    prog.run(backend=backend)
    first, second = backend.requests
    assert first["max_new_tokens"] == 16 and first["min_new_tokens"] == 4 and first["stop_regex"] == [r"\d+"]
    assert second["min_new_tokens"] == 2 and second["token_healing"] is True
    with pytest.raises(ValueError, match="fork"):
        rl.gen("x", n=2)
    with pytest.warns(UserWarning, match="only dtype"):
        both = rl.gen("x", dtype=int, regex="[a-z]+")
    assert both.params.sampling_params()["regex"] == REGEX_INT
    with pytest.raises(ValueError, match="invalid regex"):
        rl.gen("x", regex="[a-")


def test_error_is_a_method_and_multimodal_is_refused():
    @rl.function
    def prog(s):
        s += rl.gen("x", temperature=-1)

    state = prog.run(backend=Scripted([]), stream=True)
    assert callable(state.error)
    state.sync()
    assert isinstance(state.error(), IndexError)  # the scripted backend has no answer left
    for call in (lambda: rl.image("cat.png"), lambda: rl.video("clip.mp4", 4)):
        with pytest.raises(NotImplementedError, match="multimodal"):
            call()


def test_text_async_iter_concatenates_to_the_variable():
    backend = Scripted(["one two three four five"], stream_pieces=4)

    @rl.function
    def prog(s):
        s += "Count: " + rl.gen("count", max_tokens=8)

    async def collect(var, meta):
        state = prog.run(backend=backend, stream=True)
        return state, [p async for p in state.text_async_iter(var, return_meta_data=meta)]

    state, pieces = asyncio.run(collect("count", False))
    assert "".join(pieces) == state["count"] == "one two three four five"
    backend.answers = ["alpha beta"]
    state, pairs = asyncio.run(collect("count", True))
    assert "".join(p for p, _ in pairs) == state["count"] and all("piece" in m for _, m in pairs)
    backend.answers = ["x y"]
    state, pieces = asyncio.run(collect(None, False))
    assert "".join(pieces) == state.text() == "Count: x y"


def test_global_config(capsys, monkeypatch):
    backend = Scripted(["hello"])
    monkeypatch.setattr(rl.global_config, "default_backend", None)
    rl.set_default_backend(backend)
    assert rl.global_config.default_backend is backend and rl.get_default_backend() is backend
    monkeypatch.setattr(rl.global_config, "verbosity", 2)
    rl.function(lambda s: s.__iadd__("Say: " + rl.gen("x"))).run()
    assert capsys.readouterr().out == "Say: hello\n"
    from radixlm.lang.global_config import global_config

    assert global_config is rl.global_config


def test_trace_and_precache_for_run_batch():
    @rl.function
    def qa(s, question, context="ctx"):
        s += rl.system("You answer questions about the solar system. " * 3)
        s += rl.user(question)
        s += rl.assistant(rl.gen("answer", stop="\n"))

    backend = Scripted([])
    traced = qa.trace(backend=backend)
    kinds = [type(n).__name__ for n in traced.flatten_nodes()]
    assert kinds == ["RoleBegin", "Constant", "RoleEnd", "RoleBegin", "Argument", "RoleEnd", "RoleBegin", "Gen",
                     "RoleEnd"]
    assert "answer" in traced.variables
    system = backend.chat_template.begin("system", True) + "You answer questions about the solar system. " * 3
    assert traced.prefix_text() == system + backend.chat_template.end("system") + backend.chat_template.begin(
        "user", False)
    backend.answers = ["Mars\n", "Venus\n"]
    states = qa.run_batch([("Red planet?",), {"question": "Hottest?"}], backend=backend, num_threads=1)
    assert [s["answer"] for s in states] == ["Mars", "Venus"]
    assert backend.cached == [traced.prefix_text()]  # cached once, before the batch
    backend.answers = ["Earth\n"]
    assert [s["answer"] for s in qa.run_batch([("Home?",)], backend=backend, generator_style=True)] == ["Earth"]
    with pytest.raises(TypeError, match="argument values"):
        qa.run_batch([("a", "b", "c")], backend=backend)


class FakeChat:
    """openai.OpenAI stand-in: scripted chat/completions answers, usage 3 + 2 tokens each."""

    def __init__(self, answers: list[str]) -> None:
        self.answers, self.requests = list(answers), []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        self.completions = SimpleNamespace(create=self._create)

    def _create(self, **kwargs):
        self.requests.append(kwargs)
        text = self.answers.pop(0)
        usage = SimpleNamespace(prompt_tokens=3, completion_tokens=2)
        choice = SimpleNamespace(message=SimpleNamespace(content=text), text=text, finish_reason="length")
        return SimpleNamespace(id="x", usage=usage, choices=[choice])


def test_openai_token_usage_and_chat_speculation():
    client = FakeChat(["Paris\nFrance is in Europe.\nextra", "ignored"])
    backend = rl.OpenAI("gpt-test", client=client)

    @rl.function(num_api_spec_tokens=64)
    def prog(s):
        s += rl.user("Capital of France, then a fact.")
        s += rl.assistant("Capital: " + rl.gen("capital", stop="\n") + "\n" + rl.gen("fact", stop="\n"))

    client.answers[0] = "Capital: " + client.answers[0]
    state = prog.run(backend=backend, temperature=0)
    assert (state["capital"], state["fact"]) == ("Paris", "France is in Europe.")
    assert state.messages()[-1]["content"] == "Capital: Paris\nFrance is in Europe."
    assert len(client.requests) == 1 and client.requests[0]["max_tokens"] == 64
    assert (backend.token_usage.prompt_tokens, backend.token_usage.completion_tokens) == (3, 2)
    backend.token_usage.reset()
    assert backend.token_usage.prompt_tokens == 0
    client.answers = ["Something else entirely"] * 3
    failed = prog.run(backend=backend, temperature=0)
    assert "speculative" in str(failed.error()) and len(client.requests) == 4
    plain = rl.function(lambda s: s.__iadd__(rl.assistant("Hi " + rl.gen("x")))).run(backend=backend)
    assert "num_api_spec_tokens" in str(plain.error())  # without speculation: the clear refusal


def test_completion_speculation_matches_and_saves_calls():
    questions = ["Q: 1+1?\nA:", "\nQ: 2+2?\nA:"]

    def prog(s):
        s += questions[0] + rl.gen("a", stop="\n") + questions[1] + rl.gen("b", stop="\n") + "\nQ: done"

    spec = Scripted([" 2\nQ: 2+2?\nA: 4\nQ: 3+3?"])
    state = rl.function(prog, num_api_spec_tokens=32).run(backend=spec, temperature=0)
    assert (state["a"], state["b"]) == (" 2", " 4") and len(spec.requests) == 1
    assert spec.requests[0]["max_new_tokens"] == 128 and "stop" not in spec.requests[0]
    plain = Scripted([" 2\n", " 4\n"])
    reference = rl.function(prog).run(backend=plain, temperature=0)
    assert reference.text() == state.text() and len(plain.requests) == 2
    drift = Scripted([" 2\nQ: something else", " 4\n"])  # the text after the gen does not match
    state = rl.function(prog, num_api_spec_tokens=32).run(backend=drift, temperature=0)
    assert (state["a"], state["b"]) == (" 2", " 4") and len(drift.requests) == 2


def test_runtime_checks_its_options_before_starting_a_server():
    with pytest.raises(TypeError, match="bogus_option"):
        rl.Runtime(model_path="smollm2-135m", bogus_option=1)
    with pytest.raises(ValueError, match="one device"):
        rl.Runtime(model_path="smollm2-135m", tp_size=2)


@given(st.lists(st.tuples(st.booleans(), st.text("ab\n", min_size=1, max_size=4)), min_size=1, max_size=6))
@settings(max_examples=examples(200), deadline=None)
def test_speculation_match_recovers_what_the_answer_was_built_from(parts):
    """match() on an answer made of the items' own texts gives those texts back (gens stop at "\\n";
    their text has none, and the next item starts with the stop or is the end)."""
    from radixlm.lang.ir import GenParams
    from radixlm.lang.speculative import _Item, match

    items, answer = [], ""
    for k, (is_gen, text) in enumerate(parts):
        if is_gen:
            text = text.replace("\n", "")
            nxt = parts[k + 1] if k + 1 < len(parts) else None
            if not text or (nxt is not None and (nxt[0] or not nxt[1].startswith("\n"))):
                continue  # a gen's value ends where a "\n" begins
            items.append(_Item(None, "v", GenParams(stop=["\n"])))
        else:
            items.append(_Item(text))
        answer += text
    values = match(items, answer)
    assert values is not None and "".join(values) == answer
    assert all(i.text is None or v == i.text for i, v in zip(items, values))
