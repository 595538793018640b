"""radixlm.lang's roles and backends against the fake Engine of tests/test_lang.py: roles render exactly the
chat template, an Engine is a default backend, RuntimeEndpoint over HTTP and OpenAI drive the same programs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from test_lang import SMOL_TEMPLATE, FakeEngine, expected_reply

import radixlm.lang as rl
from radixlm.lang.ir import REGEX_INT

PLAIN_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


# --- roles ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("template", [SMOL_TEMPLATE, PLAIN_CHATML], ids=["smollm2", "chatml"])
@pytest.mark.parametrize("with_system", [True, False], ids=["system", "no-system"])
def test_roles_render_exactly_the_chat_template(template, with_system):
    fake = FakeEngine(template=template)

    @rl.function
    def chat(s):
        if with_system:
            s += rl.system("You are terse.")
        with s.user():
            s += "What is " + "2+2?"
        s += rl.assistant(rl.gen("a1", max_tokens=16))
        s.user("And 3+3?")
        with s.assistant():
            s += rl.gen("a2", max_tokens=16)

    state = chat.run(backend=fake)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system"] * with_system + ["user", "assistant"] * 2
    assert state.text() == fake.apply_chat_template(messages, add_generation_prompt=False)
    first_gen = fake.calls[0]
    opening = messages[: 1 + with_system]
    assert first_gen["prompt"] == fake.apply_chat_template(opening, add_generation_prompt=True)
    assert state["a1"] == expected_reply(first_gen["prompt"])
    for call in fake.calls:  # a gen inside a role stops at the role's end marker
        assert "<|im_end|>" in call["sampling_params"]["stop"]
        assert fake.tokenizer.eos_token_id in call["sampling_params"]["stop_token_ids"]


def test_default_backend_accepts_an_engine_directly(fake, monkeypatch):
    monkeypatch.setattr(rl.global_config, "default_backend", None)
    with pytest.raises(RuntimeError, match="set_default_backend"):
        rl.function(lambda s: None).run()
    rl.set_default_backend(fake)
    assert rl.as_backend(fake) is rl.get_default_backend()
    state = rl.function(lambda s: s.__iadd__("Hi" + rl.gen("x"))).run()
    assert state["x"] == expected_reply("Hi")
    assert rl.flush_cache() is True
    assert rl.get_server_info() == {"model": "fake"}


# --- other backends -------------------------------------------------------------------------------

def http_bridge(fake: FakeEngine, api_key: str):
    """An httpx transport serving the native HTTP API from a FakeEngine."""

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == f"Bearer {api_key}"
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        if path == "/generate":
            out = fake.generate(prompt=body.get("text"), input_ids=body.get("input_ids"),
                                sampling_params=body.get("sampling_params"),
                                return_logprob=body.get("return_logprob", False),
                                logprob_start_len=body.get("logprob_start_len", -1),
                                stream=body.get("stream", False))
            if body.get("stream"):  # the fake Engine's chunks are cumulative, as a server's (SGLang's convention)
                events = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in out) + "data: [DONE]\n\n"
                sse = {"content-type": "text/event-stream"}
                return httpx.Response(200, content=events.encode(), headers=sse)
            return httpx.Response(200, json=out)
        if path == "/apply_chat_template":
            return httpx.Response(200, json={"text": fake.apply_chat_template(body["messages"],
                                                                              body["add_generation_prompt"])})
        if path == "/server_info":
            return httpx.Response(200, json=fake.get_server_info())
        if path == "/flush_cache":
            return httpx.Response(200)
        return httpx.Response(404, json={"error": "no route"})

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("with_tokenizer", [False, True], ids=["heuristic", "tokenizer"])
def test_runtime_endpoint_over_http(fake, with_tokenizer):
    fake.liked = {"Paris"}
    endpoint = rl.RuntimeEndpoint("http://radixlm.test", api_key="k", transport=http_bridge(fake, "k"),
                                  tokenizer=fake.tokenizer if with_tokenizer else None)

    @rl.function
    def prog(s):
        s += rl.user("Capital of France?")
        s += rl.assistant(rl.gen("answer", max_tokens=8))
        s += "The capital of France is " + rl.select("city", choices=["London", "Paris"])

    state = prog.run(backend=endpoint)
    assert state.error() is None
    assert state["city"] == "Paris"
    assert state.text().startswith(fake.apply_chat_template(state.messages(), add_generation_prompt=False))
    meta = state.get_meta_info("city")
    scored = [fake.tokenizer.decode([e[1] for e in lps]) for lps in meta["input_token_logprobs"]]
    assert scored == [" London", " Paris"]
    streamed = rl.function(lambda s: s.__iadd__("Go" + rl.gen("x"))).run(backend=endpoint, stream=True)
    assert "".join(streamed.text_iter("x")) == expected_reply("Go")
    assert rl.get_server_info(endpoint) == {"model": "fake"} and rl.flush_cache(endpoint) is True


class FakeOpenAIClient:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._chat))

    def _chat(self, **kwargs):
        self.requests.append(kwargs)
        schema_name = kwargs.get("response_format", {}).get("json_schema", {}).get("name")
        content = '{"choice": "blue"}' if schema_name == "choice" else "Hello there"
        return SimpleNamespace(
            id="chatcmpl-1", usage=SimpleNamespace(prompt_tokens=3, completion_tokens=2),
            choices=[SimpleNamespace(message=SimpleNamespace(content=content), finish_reason="stop")],
        )


def test_openai_backend_maps_roles_to_messages():
    client = FakeOpenAIClient()
    backend = rl.OpenAI("gpt-test", client=client)

    @rl.function
    def prog(s):
        s += rl.system("Be brief.")
        s += rl.user("Hi!")
        s += rl.assistant(rl.gen("reply", max_tokens=5, json_schema={"type": "object"}))
        s += rl.user("Pick a color")
        s += rl.assistant(rl.select("color", choices=["red", "blue"]))

    state = prog.run(backend=backend, temperature=0, top_k=5)
    assert state["reply"] == "Hello there" and state["color"] == "blue"
    first = client.requests[0]
    system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}
    assert first["messages"] == [system, user]
    assert first["max_tokens"] == 5 and first["temperature"] == 0 and first["extra_body"] == {"top_k": 5}
    assert first["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert state.messages()[-1] == {"role": "assistant", "content": "blue"}


def test_openai_backend_explains_its_limits():
    backend = rl.OpenAI("gpt-test", client=FakeOpenAIClient())
    regex = rl.function(lambda s: s.__iadd__(rl.assistant(rl.gen("n", dtype=int)))).run(backend=backend)
    assert isinstance(regex.error(), NotImplementedError) and "regex" in str(regex.error())
    outside = rl.function(lambda s: s.__iadd__(rl.user("Hi") + rl.gen("x"))).run(backend=backend)
    assert "assistant role" in str(outside.error())
    client = FakeOpenAIClient()
    allowed = rl.OpenAI("m", client=client, supports_regex=True)
    rl.function(lambda s: s.__iadd__(rl.assistant(rl.gen("n", dtype=int)))).run(backend=allowed)
    assert client.requests[0]["extra_body"]["regex"] == REGEX_INT and client.requests[0]["stop"] == [" ", "\n"]
