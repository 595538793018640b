"""Bad input, limits and faults against a real server (API key on, small context, tiny queue):
each bad request gets its 4xx with an OpenAI-shaped body naming the problem, and the server keeps
serving; a full queue answers 503 with Retry-After; a dead scheduler is restarted."""

from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest
from server_helpers import assert_error

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
CONTEXT = 512
MAX_BYTES = 64 * 1024
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    from radixlm.server import launch_server

    handle = launch_server(model="smollm2-135m", port=0, api_key=KEY, context_length=CONTEXT, max_total_tokens=4096,
                           max_running_requests=2, max_queued_requests=1, max_request_bytes=MAX_BYTES,
                           log_level="warning")
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


def chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 4, "temperature": 0, **fields}


def gen(**fields) -> dict:
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}, **fields}


LONG_PROMPT = "word " * (CONTEXT + 10)


def nested(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "array", "items": value}
    return value

# (name, path, json body or raw bytes, status, words the message must contain, param or None)
MATRIX = [
    ("invalid json", CHAT, b"{not json", 400, ["not valid JSON"], None),
    ("empty body", "/generate", b"", 400, ["empty"], None),
    ("body not an object", CHAT, [1, 2], 400, ["JSON object"], None),
    ("missing messages", CHAT, {"max_tokens": 4}, 400, ["messages", "required"], "messages"),
    ("mistyped max_tokens", CHAT, chat(max_tokens="10"), 400, ["max_tokens"], "max_tokens"),
    ("negative max_tokens", CHAT, chat(max_tokens=-1), 400, ["max_tokens", ">= 0"], "max_tokens"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**9), 400, ["max_tokens", "context length"], "max_tokens"),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, ["role"], "messages.0.role"),
    ("unknown field", CHAT, chat(temprature=0.5), 400, ["temprature"], "temprature"),
    ("bad temperature", CHAT, chat(temperature=-1), 400, ["temperature"], "temperature"),
    ("n zero", CHAT, chat(n=0), 400, ["n must be >= 1"], "n"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, ["logprobs"], "top_logprobs"),
    ("prompt over context", CHAT, chat(messages=[{"role": "user", "content": LONG_PROMPT}]), 400,
     ["context length"], "prompt"),
    ("lora_path set", CHAT, chat(lora_path="my-adapter"), 400, ["lora_path", "not supported"], "lora_path"),
    ("image part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, ["'image_url' part", "text-only"], "messages.0.content.0.type"),
    ("seed past 64 bits", CHAT, chat(seed=2**70), 400, ["seed"], "seed"),
    ("logprob_start_len past 64 bits", "/generate", gen(logprob_start_len=2**70), 400, ["logprob_start_len"],
     "logprob_start_len"),
    ("invalid utf-8", "/generate", b'{"text": "\xff\xfe"}', 400, ["UTF-8"], None),
    ("deep nesting", CHAT, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, ["nests deeper"], None),
    ("deep tool parameters", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"anyOf": [{"type": "string"}] * 0 + [nested(80)]}}}}}]), 400,
     ["nests deeper"], "tools"),
    ("bad stop_regex", "/generate", gen(sampling_params={"stop_regex": "(", "max_new_tokens": 4}), 400,
     ["stop_regex"], "sampling_params.stop_regex"),
    ("min_tokens over max_tokens", CHAT, chat(min_tokens=9), 400, ["min_tokens"], "min_tokens"),
    ("image_data set", "/generate", gen(image_data="data:image/png;base64,AAAA"), 400, ["image_data"],
     "image_data"),
    ("unknown tool in tool_choice", CHAT,
     chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "launch_rocket"}}), 400,
     ["launch_rocket", "get_weather"], "tool_choice"),
    ("tool_choice without tools", CHAT, chat(tool_choice="required"), 400, ["tools"], "tool_choice"),
    ("invalid json schema", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, ["json_schema"], None),
    ("completions empty prompt", "/v1/completions", {"prompt": [], "max_tokens": 2}, 400, ["prompt"], "prompt"),
    ("completions bad logprobs", "/v1/completions", {"prompt": "x", "logprobs": 99}, 400, ["logprobs"], "logprobs"),
    ("generate text and ids", "/generate", gen(input_ids=[1, 2]), 400, ["exactly one"], None),
    ("generate unknown sampling field", "/generate", gen(sampling_params={"temprature": 1}), 400,
     ["temprature"], "sampling_params.temprature"),
    ("generate mistyped stream", "/generate", gen(stream="yes"), 400, ["stream"], "stream"),
    ("generate unknown field", "/generate", gen(foo=1), 400, ["foo"], "foo"),
    ("generate ids out of vocab", "/generate", {"input_ids": [1, 10**9]}, 400, ["input_ids"], "input_ids"),
    ("generate invalid regex", "/generate", gen(sampling_params={"regex": "(unclosed", "max_new_tokens": 4}), 400,
     ["regex"], None),
    ("generate schema not json", "/generate", gen(sampling_params={"json_schema": "{nope", "max_new_tokens": 4}),
     400, ["json_schema"], None),
    ("generate huge max_new_tokens", "/generate", gen(sampling_params={"max_new_tokens": 10**6}), 400,
     ["max_new_tokens", "context length"], "sampling_params.max_new_tokens"),
    ("body too large", "/generate", gen(text="x" * (MAX_BYTES + 1)), 413, ["max_request_bytes"], None),
    ("unknown route", "/v1/embeddings", {"input": "x"}, 404, ["/v1/embeddings"], None),
]


@pytest.mark.parametrize("name, path, body, status, words, param", MATRIX, ids=[row[0] for row in MATRIX])
def test_bad_input_gets_a_4xx_naming_the_problem(http, name, path, body, status, words, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert_error(r, status, *words, param=param)


def test_server_still_serves_after_the_matrix(http):
    assert http.post("/generate", json=gen()).json()["meta_info"]["completion_tokens"] == 4
    out = http.post(CHAT, json=chat()).json()
    assert out["choices"][0]["message"]["content"]


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + CHAT, json=chat(), headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert "api key" in r.json()["error"]["message"].lower()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200, "health needs no key"
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_full_queue_answers_503_with_retry_after(http):
    def long(i: int) -> httpx.Response:
        return http.post("/generate", json={"text": "Tell me a long story.", "rid": f"long-{i}", "sampling_params": {
            "max_new_tokens": 480, "ignore_eos": True, "temperature": 0}})

    with cf.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(long, i) for i in range(3)]  # max_running_requests + max_queued_requests
        deadline = time.monotonic() + 30
        while http.get("/server_info").json()["in_flight"] < 3:
            assert time.monotonic() < deadline and not any(f.done() for f in running)
            time.sleep(0.05)
        r = http.post("/generate", json=gen())
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        for i in range(3):
            assert http.post("/abort_request", json={"rid": f"long-{i}"}).status_code == 200
        finished = [f.result().json()["meta_info"]["finish_reason"] for f in running]
    assert [f["type"] for f in finished] == ["abort"] * 3
    assert http.get("/server_info").json()["in_flight"] == 0
    assert http.post("/generate", json=gen()).status_code == 200
