"""The server end to end over real HTTP on SmolLM2: the official openai client, the native
/generate API against an in-process Engine, 64 concurrent requests, a client that disconnects,
metrics. One server for the whole module."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import jsonschema
import pytest
from server_helpers import wait_idle

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

GREEDY = {"temperature": 0, "max_new_tokens": 8}
QUESTIONS = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.", "hi",
             "What is the capital of France?", "Count to five.", "Say something nice.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def server():
    from radixlm.server import launch_server

    # float32, as the engine below: answers compared across the two must not depend on what each one's
    # cache holds (the default int4's bfloat16 rows can flip a near-tie with it: README, quantization)
    handle = launch_server(model="smollm2-135m", port=0, quantization="none", max_total_tokens=8192,
                           log_level="warning")
    yield handle
    assert handle.shutdown() == 0, "the server should drain and exit cleanly on SIGTERM"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine():
    from radixlm.runtime import Engine

    with Engine(model="smollm2-135m", quantization="none", max_total_tokens=4096, log_level="warning") as e:
        yield e


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def assert_pool_idle(info: dict) -> None:
    assert info["cache"]["protected_size"] == 0, "a finished request still locks cache nodes"
    assert info["free_slots"] + info["cache"]["evictable_size"] == info["max_total_tokens"], "KV slots leaked"


# --------------------------------------------------------------------------- openai client
def test_models_and_health(http, client):
    assert http.get("/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]


def test_chat_plain(client):
    out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streamed_equals_plain_and_reports_usage(client):
    kwargs = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Name three colors."}],
                  max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "the second identical prompt hits the cache"


def test_chat_n2_with_seed_and_logprobs(client):
    out = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Say a word"}],
                                         max_tokens=6, n=2, seed=7, temperature=0.8, logprobs=True, top_logprobs=2)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        items = c.logprobs.content
        assert 0 < len(items) <= 6
        assert all(it.logprob <= 0 and len(it.top_logprobs) == 2 for it in items)
    streamed = list(client.chat.completions.create(model="smollm2-135m", n=2, max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "hi"}], stream=True))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}


def test_completions_text_echo_and_logprobs(client, engine):
    out = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=5,
                                    temperature=0, echo=True, logprobs=1)
    want = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 5})
    choice = out.choices[0]
    assert choice.text == "The capital of France is" + want["text"]
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == out.usage.prompt_tokens + 5
    for batch_prompt in (["One, two,", "Red, green,"], [[504, 2988], [28, 260]]):
        batch = client.completions.create(model="smollm2-135m", prompt=batch_prompt, max_tokens=3, temperature=0,
                                          n=2)
        assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="smollm2-135m", max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Invent a person; answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def test_tools_required_arguments_validate(client):
    out = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=80, temperature=0,
                                         parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tools_named_choice(client):
    out = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                         tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                         temperature=0)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tools_auto_text_or_valid_call(client):
    for stream in (False, True):
        kwargs = dict(model="smollm2-135m", messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=60,
                      temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            calls: dict[int, str] = {}  # arguments stream in fragments: joined per call
            for tc in (tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])):
                calls[tc.index] = calls.get(tc.index, "") + (tc.function.arguments or "")
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            args = list(calls.values())
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            finish, args = choice.finish_reason, [tc.function.arguments for tc in choice.message.tool_calls or []]
        assert (finish == "tool_calls") == bool(args)
        for a in args:
            jsonschema.validate(json.loads(a), WEATHER["function"]["parameters"])


def test_tool_conversation_renders(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER], max_tokens=8,
                                         temperature=0, tool_choice="none")
    assert out.choices[0].message.content


# --------------------------------------------------------------------------- native /generate
def test_generate_single_batch_and_logprobs_equal_engine(http, engine, prompts):
    single = http.post("/generate", json={"text": prompts[0], "sampling_params": GREEDY}).json()
    assert single["output_ids"] == engine.generate(prompts[0], GREEDY)["output_ids"]
    assert single["text"] == engine.generate(prompts[0], GREEDY)["text"]

    batch = http.post("/generate", json={"text": prompts[:3], "sampling_params": GREEDY}).json()
    assert [b["output_ids"] for b in batch] == [e["output_ids"] for e in engine.generate(prompts[:3], GREEDY)]

    ids = engine.tokenizer(prompts[1]).input_ids
    args = dict(input_ids=ids, sampling_params=GREEDY, return_logprob=True, logprob_start_len=3, top_logprobs_num=2)
    got = http.post("/generate", json=args).json()
    want = engine.generate(**args)
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [e[1] for e in got["meta_info"][key]] == [e[1] for e in want["meta_info"][key]]
        assert [e[0] for e in got["meta_info"][key]] == pytest.approx([e[0] for e in want["meta_info"][key]],
                                                                      abs=1e-4, nan_ok=True)
    assert [[t[1] for t in row] for row in got["meta_info"]["output_top_logprobs"]] == \
        [[t[1] for t in row] for row in want["meta_info"]["output_top_logprobs"]]


def test_generate_stream_is_cumulative_and_ends_equal(http, engine, prompts):
    payload = {"text": prompts[2], "sampling_params": GREEDY, "stream": True}
    chunks = []
    with http.stream("POST", "/generate", json=payload) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[5:]) for line in lines[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False)), "SGLang streams cumulative text"
    want = engine.generate(prompts[2], GREEDY)
    assert chunks[-1]["output_ids"] == want["output_ids"] and texts[-1] == want["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_runtime_endpoint_program(server, engine):
    import radixlm.lang as rl

    @rl.function
    def prog(s):
        s += rl.user("What is the capital of France?")
        s += rl.assistant(rl.gen("answer", max_tokens=8, temperature=0))
        s += "So the answer is " + rl.select("city", choices=["London", "Paris"])

    endpoint = rl.RuntimeEndpoint(server.url)
    state = prog.run(backend=endpoint)
    assert state.error() is None and state["city"] in ("London", "Paris")
    local = prog.run(backend=engine)
    assert state["answer"] == local["answer"] and state["city"] == local["city"]
    streamed = rl.function(lambda s: s.__iadd__("Once upon a time" + rl.gen("x", max_tokens=6, temperature=0)))
    pieces = list(streamed.run(backend=endpoint, stream=True).text_iter("x"))
    assert "".join(pieces) == engine.generate("Once upon a time", {"temperature": 0, "max_new_tokens": 6})["text"]
    endpoint.shutdown()


def test_64_concurrent_greedy_requests_equal_alone(http, prompts):
    distinct = [{"text": prompts[i % 8] + " " * (i // 8), "sampling_params": GREEDY} for i in range(16)]
    alone = [http.post("/generate", json=p).json()["output_ids"] for p in distinct]
    with cf.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: http.post("/generate", json=distinct[i % 16]), range(64)))
    assert all(r.status_code == 200 for r in results)
    for i, r in enumerate(results):
        assert r.json()["output_ids"] == alone[i % 16], distinct[i % 16]["text"]
    assert_pool_idle(wait_idle(http))


# --------------------------------------------------------------------------- faults and observability
def test_client_disconnect_mid_stream_aborts_and_frees_kv(server, http):
    payload = {"text": "Write a very long story about a dragon.",
               "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as other:
        with other.stream("POST", "/generate", json=payload) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break
        # leaving the block closes the connection mid-stream
    info = wait_idle(http)
    assert_pool_idle(info)
    assert http.post("/flush_cache").status_code == 200
    info = http.get("/server_info").json()
    assert info["free_slots"] == info["max_total_tokens"]
    assert http.post("/generate", json={"text": "hi", "sampling_params": GREEDY}).status_code == 200


def test_metrics(http):
    http.post("/generate", json={"text": "hi", "sampling_params": GREEDY, "stream": True})
    text = http.get("/metrics").text
    for name in ("radixlm_requests_total", "radixlm_time_to_first_token_seconds_bucket",
                 "radixlm_inter_token_latency_seconds_bucket", "radixlm_e2e_request_latency_seconds_bucket",
                 "radixlm_num_running_requests", "radixlm_num_waiting_requests", "radixlm_kv_slots_used",
                 "radixlm_cache_hit_rate"):
        assert name in text, name
    assert 'radixlm_requests_total{model_name="smollm2-135m",route="/generate",status="200"}' in text


def test_sigterm_drains_in_flight_requests_then_exits(server):
    """Last in this module: it stops the server."""
    payload = {"text": "Count from one to fifty:", "stream": True,
               "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/generate", json=payload) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        server.process.terminate()  # SIGTERM while the request is in flight
        rest = [line for line in lines if line.startswith("data:")]
    chunks = [json.loads(line[5:]) for line in [first, *rest[:-1]]]
    assert rest[-1] == "data: [DONE]"
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}, "the request was cut short"
    assert len(chunks[-1]["output_ids"]) == 24
    server.process.join(60)
    assert server.process.exitcode == 0
