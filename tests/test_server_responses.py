"""POST /v1/responses (OpenAI's Responses API over the chat path), GET and DELETE of stored
responses, against one real server (SmolLM2, greedy): the openai client's create, stream and parse;
tools forced with tool_choice and continued with previous_response_id; the bounded store; 400s
naming the field; and the Agents SDK's default model, LangChain's use_responses_api and
litellm.responses end to end. A 135M model: tool calls are forced and outputs constrained, so
what is checked is the wire and the constraints, not the model's judgement."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_helpers import assert_error, wait_idle

from radixlm.server.responses_store import Conversation, ResponseStore

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
GREEDY = {"temperature": 0, "max_output_tokens": 24}


@pytest.fixture(scope="module")
def server():
    from radixlm.server import launch_server

    # float32: tests here compare logprobs of a request answered cold with its repeat on a warm cache, which
    # int4's bfloat16 rows move by a few hundredths (README, --quantization)
    handle = launch_server(model="smollm2-135m", port=0, context_length=2048, max_total_tokens=8192,
                           quantization="none", log_level="warning")
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# --------------------------------------------------------------------------- text, instructions, streaming
def test_create_text_with_usage_and_store(client, http):
    r = client.responses.create(model="default", input="Name a color.", **GREEDY)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    again = client.responses.create(model="default", input="Name a color.", **GREEDY)
    assert again.output_text == r.output_text, "greedy"
    assert again.usage.input_tokens_details.cached_tokens > 0, "the same prompt again hits the radix cache"
    assert client.responses.retrieve(r.id).output_text == r.output_text
    wait_idle(http)


def test_instructions_become_the_system_turn_as_in_chat(client):
    told = client.responses.create(input="Say something.", instructions="Answer only in French.", **GREEDY)
    chat = client.chat.completions.create(model="default", temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Answer only in French."}, {"role": "user", "content": "Say something."}])
    assert told.instructions == "Answer only in French."
    assert told.usage.input_tokens == chat.usage.prompt_tokens and told.output_text == chat.choices[0].message.content


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(input="Count from one to one hundred.", temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_stream_events_in_order_and_deltas_equal_the_plain_text(client):
    plain = client.responses.create(input="Tell me about tea.", **GREEDY)
    events = list(client.responses.create(input="Tell me about tea.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if plain.status == "incomplete" else "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 6
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.output[0].id == events[2].item.id
    assert client.responses.retrieve(events[-1].response.id).output_text == text, "stored once finished"


def test_stream_helper_gets_the_final_response(client):
    with client.responses.stream(model="default", input="Hello!", temperature=0, max_output_tokens=400) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text


# --------------------------------------------------------------------------- structured output
def test_text_format_json_schema_validates(client):
    r = client.responses.create(input="Invent a person.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


def test_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=16)
        country: str = Field(max_length=16)

    r = client.responses.parse(input="Name a city in Italy.", text_format=City, temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, City)


def test_json_object_format(client):
    r = client.responses.create(input='Reply with a JSON object such as {"ok": true}.', temperature=0,
                                max_output_tokens=60, text={"format": {"type": "json_object"}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


# --------------------------------------------------------------------------- tools and previous_response_id
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_forced_tool_call_then_its_output_continues(client, choice):
    first = client.responses.create(input="What's the weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                    temperature=0, max_output_tokens=60)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    assert first.output[0].type == "function_call", "a forced call is the whole output"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    second = client.responses.create(
        previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=24,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"temp_c": 21})}
               for c in calls])
    # under auto this small model may call the tool again (a call cut off by max_output_tokens stays a
    # partial call, as OpenAI reports it): the answer is text or calls, never nothing
    assert second.previous_response_id == first.id and second.output
    assert all(o.type in ("message", "function_call") for o in second.output)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1, \
        "the continued conversation reuses the first prompt's cache"


def test_streamed_forced_tool_call(client):
    events = list(client.responses.create(input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                          stream=True, temperature=0, max_output_tokens=60))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1, "the arguments stream as they form"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas), "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    done = events[-3]
    assert "".join(d.delta for d in deltas) == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    assert events[-1].response.output[0].call_id == events[2].item.call_id
    plain = client.responses.create(input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                    temperature=0, max_output_tokens=60)
    assert plain.output[0].arguments == done.arguments, "streamed and plain calls are the same text"


def test_items_round_trip_without_the_store(client, http):
    """The Agents SDK's way: the whole conversation, the model's own output items sent back."""
    first = client.responses.create(input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                    store=False, temperature=0, max_output_tokens=60)
    assert http.get(f"/v1/responses/{first.id}").status_code == 404, "store: false keeps nothing"
    items: list = [{"role": "user", "content": "Weather in Oslo?"}]
    items += [o.model_dump(exclude_none=True) for o in first.output]
    items += [{"type": "function_call_output", "call_id": o.call_id, "output": "cloudy"}
              for o in first.output if o.type == "function_call"]
    second = client.responses.create(input=items, tools=[WEATHER], store=False, temperature=0, max_output_tokens=24)
    assert second.output and all(o.type in ("message", "function_call") for o in second.output)


def test_deleted_while_streaming_is_never_stored(client, http):
    with client.responses.stream(model="m", input="Tell me a long story.", temperature=0,
                                 max_output_tokens=48) as events:
        created = next(e for e in events if e.type == "response.created").response
        assert created.store is True
        assert http.delete(f"/v1/responses/{created.id}").json()["deleted"] is True
        final = [e for e in events][-1].response  # response.completed or .incomplete
    assert final.id == created.id and final.store is False
    assert_error(http.get(f"/v1/responses/{created.id}"), 404, "not found")
    assert_error(http.delete(f"/v1/responses/{created.id}"), 404, "not found")


def test_get_and_delete(client, http):
    r = client.responses.create(input="Hi", temperature=0, max_output_tokens=4)
    got = http.get(f"/v1/responses/{r.id}").json()
    assert got["id"] == r.id and got["output"][0]["content"][0]["text"] == r.output_text
    assert http.delete(f"/v1/responses/{r.id}").json() == {"id": r.id, "object": "response", "deleted": True}
    assert_error(http.get(f"/v1/responses/{r.id}"), 404, "not found", param="response_id")
    assert_error(http.delete(f"/v1/responses/{r.id}"), 404, "not found")
    error = assert_error(http.post("/v1/responses", json={"input": "x", "previous_response_id": r.id}), 400,
                         "not found", param="previous_response_id")
    assert error["code"] == "previous_response_not_found"


# --------------------------------------------------------------------------- refused requests
@pytest.mark.parametrize("body, param, word", [
    ({"input": "hi", "temprature": 0}, "temprature", "extra"),
    ({"input": "hi", "max_output_tokens": -1}, "max_output_tokens", ""),
    ({"input": "hi", "temperature": "hot"}, "temperature", ""),
    ({"input": "hi", "temperature": -1}, "temperature", ""),
    ({"input": "hi", "top_p": 7}, "top_p", ""),
    ({"input": [{"type": "computer_call"}]}, "input.0", "type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type", ""),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0", "function tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "required"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": []}, "input", "empty"),
    ({"input": "hi", "metadata": {"k": "v" * 600}}, "metadata", ""),
    ({"input": "hi", "include": ["message.output_text.logprobs", "output_text.everything"]}, "include.1",
     "output_text.everything"),
    ({"input": "hi", "tools": [WEATHER, {**WEATHER, "description": "again"}]}, "tools.1.name", "unique"),
])
def test_bad_requests_name_the_field(http, body, param, word):
    assert_error(http.post("/v1/responses", json=body), 400, word, param=param)


def test_known_fields_are_accepted(client):
    r = client.responses.create(input="hi", temperature=0, max_output_tokens=4, reasoning={"effort": "low"},
                                truncation="auto", parallel_tool_calls=True, metadata={"team": "a"}, user="u1",
                                include=["message.output_text.logprobs"], top_logprobs=2, store=True,
                                extra_body={"service_tier": "auto", "prompt_cache_key": "k", "top_k": 5})
    assert r.metadata == {"team": "a"} and r.user == "u1"
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens and len(logprobs[0].top_logprobs) == 2
    events = list(client.responses.create(input="hi", temperature=0, max_output_tokens=4, stream=True,
                                          include=["message.output_text.logprobs"], top_logprobs=1))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in logprobs]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-3)


# --------------------------------------------------------------------------- the store's bounds
def test_store_evicts_least_recently_used_past_its_bounds():
    def response(i: int, size: int = 10) -> dict:
        return {"id": f"resp_{i}", "pad": "x" * size}

    empty = Conversation()
    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for i in range(3):
        assert store.put(response(i), empty)
    assert store.get("resp_0") is None and len(store) == 2
    store.get("resp_1")  # now the most recently used: resp_2 goes next
    store.put(response(3), empty)
    assert store.get("resp_1") is not None and store.get("resp_2") is None
    by_bytes = ResponseStore(max_responses=100, max_bytes=1000)
    for i in range(5):
        by_bytes.put(response(i, 300), empty.extend([{"type": "message"}]))
    assert by_bytes.bytes <= 1000 and len(by_bytes) == 2
    assert not by_bytes.put(response(9, 2000), empty) and by_bytes.get("resp_9") is None, "too big alone: not kept"
    assert by_bytes.delete("resp_4") and not by_bytes.delete("resp_4")
    assert json.loads(by_bytes.get("resp_3").response) == response(3, 300), "a stored copy, not the caller's object"


def test_a_continued_conversation_shares_the_stored_turns():
    store = ResponseStore(max_responses=10, max_bytes=10_000)
    first = Conversation().extend([{"type": "message", "role": "user", "content": "a" * 100}])
    store.put({"id": "resp_1"}, first)
    second = store.get("resp_1").conversation.extend([{"type": "message", "role": "user", "content": "b"}])
    assert second.chunks[0] is first.chunks[0], "the first turn's bytes are shared, not copied"
    assert [i["content"] for i in second.decode()] == ["a" * 100, "b"]
    assert store.fits(second) and not ResponseStore(max_bytes=second.size).fits(second)


def test_a_response_deleted_while_it_is_generated_is_never_stored():
    store = ResponseStore()
    store.begin("resp_1")
    assert store.delete("resp_1") and not store.delete("resp_1")
    assert not store.put({"id": "resp_1"}, Conversation()) and store.get("resp_1") is None
    store.end("resp_1")
    assert store.put({"id": "resp_1"}, Conversation()), "the id is free again once its generation ended"


def test_the_routes_need_the_api_key():
    """The Guard in front of every route but /health: in process, no model needed."""
    import asyncio

    from radixlm.server.app import Guard, _bare_app
    from radixlm.server.errors import APIError

    class NoMetrics:
        def request(self, route: str, status: int) -> None:
            pass

    inner = _bare_app()
    inner.add_exception_handler(APIError, lambda request, e: e.response())
    app = Guard(inner, api_key="k", max_bytes=1 << 20, metrics=NoMetrics(), routes=frozenset(),
                hosts=frozenset({"*"}), origins=frozenset())

    async def run() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1"),
                                 ("DELETE", "/v1/responses/resp_1")):
                r = await c.request(method, path, json={"input": "x"} if method == "POST" else None)
                assert r.status_code == 401, (method, path)
            r = await c.get("/v1/responses/resp_1", headers={"Authorization": "Bearer k"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "response_id"

    asyncio.run(run())


# --------------------------------------------------------------------------- agent frameworks (dev extras)
def test_agents_sdk_default_model_tool_loop_into_structured_output(server):
    """The Agents SDK's default model (OpenAIResponsesModel): a forced tool call, the tool's output sent
    back, then a final answer constrained to the agent's output_type; plain and streamed runs."""
    agents = pytest.importorskip("agents")
    import asyncio

    from pydantic import BaseModel, Field

    class Report(BaseModel):
        city: str = Field(max_length=20)
        sunny: bool

    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        asked.append(city)
        return f"It is sunny in {city}."

    async def run() -> tuple:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        config = agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client, use_responses=True),
                                  tracing_disabled=True)
        settings = agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60)
        agent = agents.Agent(name="weather", instructions="Answer weather questions.", tools=[get_weather],
                             output_type=Report, model_settings=settings)
        plain = await agents.Runner.run(agent, "What's the weather in Paris?", run_config=config)
        streamed = agents.Runner.run_streamed(agent, "What's the weather in Rome?", run_config=config)
        async for _ in streamed.stream_events():
            pass
        return plain, streamed

    plain, streamed = asyncio.run(run())
    assert len(asked) == 2 and all(isinstance(city, str) and city for city in asked)
    kinds = [type(item).__name__ for item in plain.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"], kinds
    assert isinstance(plain.final_output, Report) and isinstance(streamed.final_output, Report)


def test_langchain_use_responses_api_tool_call_and_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int

    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="default", temperature=0, max_tokens=60,
                        max_retries=0, use_responses_api=True)
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    msg = llm.bind_tools([tool], tool_choice="get_weather").invoke("What's the weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person) and len(person.name) <= 12
    assert "".join(chunk.text for chunk in llm.stream("Hi")), "streamed through the Responses events"


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # LiteLLM's own usage conversion
def test_litellm_responses_tool_call_and_structured_output(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the price list
    litellm = pytest.importorskip("litellm")
    kwargs = dict(model="openai/default", api_base=server.url + "/v1", api_key="x", temperature=0,
                  max_output_tokens=60)
    r = litellm.responses(input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required", **kwargs)
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    r = litellm.responses(input="Invent a person.", **kwargs,
                          text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.output[0].content[0].text), PERSON)
