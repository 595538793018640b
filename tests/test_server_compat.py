"""Wire compatibility and poisoned requests against one real server (SmolLM2, loopback):
PyPI's SGLang frontend (sglang.RuntimeEndpoint) runs its programs unchanged; the openai client
round-trips its own message.model_dump()s with tool calls; a hypothesis fuzz run gets no 5xx and
leaves nothing in flight; the Engine and the server refuse the same inputs naming the same field."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from server_helpers import wait_idle

pytestmark = pytest.mark.slow

CONTEXT = 2048


@pytest.fixture(scope="module")
def server():
    from radixlm.server import launch_server

    handle = launch_server(model="smollm2-135m", port=0, context_length=CONTEXT, max_total_tokens=8192,
                           max_running_requests=8, max_queued_requests=16, log_level="warning")
    yield handle
    handle.shutdown()


# --------------------------------------------------------------------------- the real SGLang frontend
@pytest.fixture(scope="module")
def sgl(server):
    sgl = pytest.importorskip("sglang", reason="scripts/setup.sh installs PyPI sglang's frontend (--no-deps)")
    backend = sgl.RuntimeEndpoint(server.url)
    sgl.set_default_backend(backend)
    return sgl


def test_sglang_frontend_gen_select_regex_json_roles(sgl):
    @sgl.function
    def prog(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))
        s += "\nCity: " + sgl.select("city", choices=["Paris", "London", "Rome"])
        s += "\nYear: " + sgl.gen("year", regex=r"[0-9]{4}", max_tokens=8)
        s += "\nJSON: " + sgl.gen("info", json_schema=json.dumps({
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
            "additionalProperties": False}), max_tokens=40)
        s += "\nMore: " + sgl.gen("more", max_tokens=12, min_tokens=10, temperature=0, stop="\n")

    state = prog.run(question="What is the capital of France?")
    assert state["answer"] and state["city"] in ("Paris", "London", "Rome")
    assert len(state["year"]) == 4 and state["year"].isdigit()
    assert set(json.loads(state["info"])) == {"name"}
    assert state.get_meta_info("more")["completion_tokens"] >= 10


def test_sglang_frontend_fork_run_batch_and_stream(sgl):
    @sgl.function
    def tips(s, topic):
        s += f"Three tips about {topic}:\n"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=8, temperature=0, stop="\n")
        forks.join()
        s += "Summary:" + sgl.gen("summary", max_tokens=8, temperature=0)

    states = tips.run_batch([{"topic": "sleep"}, {"topic": "tea"}], num_threads=2)
    for state in states:
        assert state.error() is None
        assert isinstance(state["tip"], list) and len(state["tip"]) == 2, "join gathers both forks' values"
        assert state["summary"] and state.get_meta_info("summary")["completion_tokens"] <= 8

    @sgl.function
    def story(s):
        s += "Once upon a time" + sgl.gen("x", max_tokens=8, temperature=0)

    streamed = story.run(stream=True)
    pieces = list(streamed.text_iter("x"))
    assert "".join(pieces) == story.run()["x"]


# --------------------------------------------------------------------------- the openai client
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}}


def test_openai_round_trips_model_dump_with_tool_calls_over_three_turns(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages: list = [{"role": "user", "content": "What's the weather in Paris, then in Rome?"}]
    for turn in range(3):
        out = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER],
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=40,
                                             temperature=0, store=False, metadata={"turn": str(turn)},
                                             logit_bias={"28": -1}, service_tier="auto")
        assert out.model == "smollm2-135m"
        message = out.choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        dumped = message.model_dump()  # refusal, annotations, audio, function_call, tool_calls...
        dumped["provider_specific_fields"] = {}  # as LiteLLM sends it back
        dumped["tool_calls"][0]["index"] = 0
        messages += [dumped, {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 20 + turn})}]
    # SGLang's routing hints (disaggregation, data-parallel ranks, n-gram corpus): accepted, no effect here
    hints = {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 7, "routed_dp_rank": 0,
             "disagg_prefill_dp_rank": 0, "ngram_corpus_id": "c"}
    final = client.chat.completions.create(model="anything-at-all", messages=messages, max_tokens=6, temperature=0,
                                           extra_body=hints)
    assert final.choices[0].message.content


# --------------------------------------------------------------------------- poisoned requests
@settings(max_examples=examples(60), deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/generate", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
                          "/abort_request", "/apply_chat_template"]),
    body=st.one_of(
        st.binary(max_size=40),
        st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80), st.floats(),
                               st.text(max_size=8)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.sampled_from(
                                                 ["text", "messages", "prompt", "sampling_params", "max_tokens",
                                                  "max_new_tokens", "seed", "n", "temperature", "role", "content",
                                                  "stop", "logit_bias", "min_tokens", "stop_regex", "tokens",
                                                  "input_ids", "rid", "stream", "logprobs", "top_logprobs",
                                                  "return_logprob", "logprob_start_len", "top_logprobs_num",
                                                  "token_ids_logprob",
                                                  "response_format", "type", "structures", "triggers",
                                                  "structured_outputs", "json", "choice", "structural_tag",
                                                  "reasoning_effort", "reasoning", "truncate_prompt_tokens",
                                                  "include_stop_str_in_output", "documents", "allowed_token_ids",
                                                  "bad_words", "return_token_ids", "return_tokens_as_token_ids"]),
                                                 inner, max_size=4)),
                     max_leaves=12)),
)
def test_fuzz_no_5xx(http, path, body):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, content=json.dumps(body, allow_nan=True).encode())
    assert r.status_code < 500, (path, body, r.text)


def test_after_the_fuzz_nothing_is_in_flight_and_requests_succeed(http):
    for _ in range(20):  # each takes a place in the queue if it leaked
        assert http.post("/generate", json={"text": "hi", "sampling_params": {"seed": 2**70}}).status_code == 400
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "seed": 2**70}).status_code == 400
    info = wait_idle(http)
    assert info["in_flight"] == 0
    assert info["free_slots"] + info["cache"]["evictable_size"] == info["max_total_tokens"], "KV slots leaked"
    ok = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_routes_cors_abort_all_and_metrics_for_every_request(http):
    r = http.put("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert r.status_code == 200
    assert http.get("/v1/models/default").json()["id"] == "smollm2-135m"
    assert http.post("/v1/tokenize", json={"prompt": "hello world"}).json()["count"] == 2
    ids = http.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"text": "hello world"}
    pre = http.options("/v1/chat/completions", headers={"Origin": "http://app.example",
                                                        "Access-Control-Request-Method": "POST"})
    # CORS is off by default: a page of another origin gets no grant (tests/test_server_security_http.py)
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    assert http.post("/abort_request", json={"abort_all": True}).json()["success"] is True
    assert http.get("/get_server_info").status_code == 200 and http.get("/model_info").status_code == 200

    def value(prefix: str) -> float:
        text = http.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))

    names = ("radixlm_request_finished_total{", "radixlm_time_to_first_token_seconds_count",
             "radixlm_queue_time_seconds_count", "radixlm_e2e_request_latency_seconds_count")
    before = [value(n) for n in names]
    for _ in range(3):  # not streamed: TTFT and queue time are recorded all the same
        assert http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}).status_code == 200
    assert [value(n) - b for n, b in zip(names, before)] == [3, 3, 3, 3]
    metrics = http.get("/metrics").text
    for name in ("radixlm_kv_usage_ratio", "radixlm_retractions_total", 'model_name="smollm2-135m"',
                 "radixlm_inter_token_latency_seconds_count"):
        assert name in metrics


def test_input_top_logprobs_and_length_in_meta_info(http):
    out = http.post("/generate", json={"text": "The capital of France is", "return_logprob": True,
                                       "logprob_start_len": 0, "top_logprobs_num": 2,
                                       "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert len(meta["input_top_logprobs"]) == len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_top_logprobs"][0] is None and all(len(row) == 2 for row in meta["input_top_logprobs"][1:])
    # SGLang's token_ids_logprob (a label scorer's request): the asked ids at each position, with their text
    ids = http.post("/tokenize", json={"prompt": " Paris London", "add_special_tokens": False}).json()["tokens"]
    scored = http.post("/generate", json={"text": "The capital of France is", "return_logprob": True,
                                          "logprob_start_len": 0, "token_ids_logprob": ids,
                                          "return_text_in_logprobs": True,
                                          "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    got = scored["meta_info"]
    assert scored["output_ids"] == out["output_ids"] and len(got["output_token_ids_logprobs"]) == 3
    for k, (lp, tid, _) in enumerate(got["output_token_logprobs"]):
        row = got["output_token_ids_logprobs"][k]
        assert [t for _, t, _ in row] == ids and [x for _, _, x in row] == [" Paris", " London"]
        assert tid not in ids or dict((t, v) for v, t, _ in row)[tid] == pytest.approx(lp, abs=1e-4)
    assert len(got["input_token_ids_logprobs"]) == meta["prompt_tokens"] and got["input_token_ids_logprobs"][0] is None


# --------------------------------------------------------------------------- Engine and server agree
SHARED = [  # (sampling params or request fields, the field both must name)
    ({"sampling_params": {"sampling_seed": 2**70}}, "sampling_seed"),
    ({"sampling_params": {"temprature": 1}}, "temprature"),
    ({"sampling_params": {"max_new_tokens": CONTEXT}}, "max_new_tokens"),
    ({"sampling_params": {"min_new_tokens": 3, "max_new_tokens": 2}}, "min_new_tokens"),
    ({"sampling_params": {"stop_regex": "(("}}, "stop_regex"),
    ({"sampling_params": {"logit_bias": {"99999999": 1}}}, "logit_bias"),
    ({"sampling_params": {"top_p": 0}}, "top_p"),
    ({"logprob_start_len": 2**70}, "logprob_start_len"),
    ({"top_logprobs_num": 99}, "top_logprobs_num"),
    ({"token_ids_logprob": [10**9]}, "token_ids_logprob"),
    ({"input_ids": [10**9], "text": None}, "input_ids"),
]


@pytest.fixture(scope="module")
def small_engine():
    from radixlm.runtime import Engine

    with Engine(model="smollm2-135m", context_length=CONTEXT, max_total_tokens=4096, log_level="warning") as e:
        yield e


@pytest.mark.parametrize("fields, field", SHARED, ids=[f for _, f in SHARED])
def test_engine_and_server_refuse_the_same_input_naming_the_same_field(http, small_engine, fields, field):
    from radixlm.runtime.request.errors import RequestError

    body = {"text": "hello", **fields}
    r = http.post("/generate", json=body)
    assert r.status_code == 400
    param = r.json()["error"]["param"]
    kwargs = {"prompt" if k == "text" else k: v for k, v in body.items()}
    with pytest.raises(RequestError) as e:
        small_engine.generate(**kwargs)
    assert e.value.field == field and param.split(".")[-1] == field


# --------------------------------------------------------------------------- agent frameworks (dev extras)
def test_langchain_bind_tools_and_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int

    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="default", temperature=0, max_tokens=60,
                        max_retries=0)
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("What's the weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    person = llm.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person) and len(person.name) <= 12


def test_litellm_tool_loop(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the price list
    litellm = pytest.importorskip("litellm")
    kwargs = dict(model="openai/default", api_base=server.url + "/v1", api_key="x", temperature=0, max_tokens=40)
    messages: list = [{"role": "user", "content": "What's the weather in Paris?"}]
    for turn in range(2):
        resp = litellm.completion(messages=messages, tools=[WEATHER], tool_choice="required", **kwargs)
        message = resp.choices[0].message
        (call,) = message.tool_calls
        assert call.function.name == "get_weather"
        messages.append(message)  # LiteLLM's documented loop: its Message goes back as it is
        messages.append({"role": "tool", "tool_call_id": call.id, "name": "get_weather",
                         "content": json.dumps({"temp_c": 21 + turn})})
    final = litellm.completion(messages=messages, **kwargs)
    assert final.choices[0].message.content
