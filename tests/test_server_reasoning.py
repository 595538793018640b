"""A Qwen3-shaped reasoning model behind the server (--reasoning-parser qwen3-thinking): the thinking
in `reasoning_content`, the Responses API's reasoning item and /generate's `reasoning_text`, streamed
and whole alike; a response_format or tool grammar that judges only the answer; thinking turned off
by chat_template_kwargs. The tiny random model's tokenizer has `<think>` and `</think>` as added
tokens, as Qwen3's has; a logit bias makes it end its thinking at once where a test needs an answer."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

CHAT = "/v1/chat/completions"
# Qwen3's shape: tools in a system turn, and with enable_thinking=false an empty thinking block written
# into the prompt (a thinking model's own template opens the block for it)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def server(make_tiny_model):
    from transformers import AutoTokenizer

    from radixlm.server import launch_server

    folder = make_tiny_model("Qwen3ForCausalLM", vocab_size=49160, head_dim=32)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    # SGLang's incremental_streaming_output: /generate's chunks carry their new text only
    handle = launch_server(model=str(folder), port=0, reasoning_parser="qwen3-thinking", max_total_tokens=4096,
                           max_running_requests=8, incremental_streaming_output=True, log_level="warning")
    handle.end_id = tok.convert_tokens_to_ids("</think>")
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def streamed_message(http: httpx.Client, body: dict, pieces: list | None = None) -> tuple[dict, dict]:
    """The message a chat stream's deltas add up to, and its last choice chunk; `pieces` gets each
    reasoning_content delta."""
    message: dict = {"content": "", "reasoning_content": ""}
    pieces = [] if pieces is None else pieces
    last = None
    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                for key in ("content", "reasoning_content"):
                    message[key] += choice["delta"].get(key) or ""
                if choice["delta"].get("reasoning_content"):
                    pieces.append(choice["delta"]["reasoning_content"])
                last = choice
    return {k: v or None for k, v in message.items()}, last


def test_thinking_cut_short_is_reasoning_and_says_so(http):
    body = {"messages": HI, "max_tokens": 8, "temperature": 0}
    choice = http.post(CHAT, json=body).json()["choices"][0]
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"], message
    assert choice["finish_reason"] == "length" and choice["reasoning_truncated"] is True
    pieces: list[str] = []
    streamed, last = streamed_message(http, body, pieces)
    assert streamed == {"content": None, "reasoning_content": message["reasoning_content"]} and len(pieces) > 1
    assert last["finish_reason"] == "length" and last["reasoning_truncated"] is True
    whole: list[str] = []  # stream_reasoning=false (SGLang's): the thinking in one piece once it ends
    assert streamed_message(http, {**body, "stream_reasoning": False}, whole)[0] == streamed
    assert whole == [message["reasoning_content"]]
    inline = http.post(CHAT, json={**body, "separate_reasoning": False}).json()["choices"][0]["message"]
    assert inline["content"] == message["reasoning_content"] and "reasoning_content" not in inline


def test_the_format_judges_the_answer_after_the_thinking(http, server):
    body = {"messages": HI, "max_tokens": 40, "temperature": 0, "logit_bias": {str(server.end_id): 100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}
    message = http.post(CHAT, json=body).json()["choices"][0]["message"]
    answer = json.loads(message["content"])  # the biased end token came first, then only JSON was allowed
    assert set(answer) == {"n"} and isinstance(answer["n"], int)
    assert message.get("reasoning_content") is None
    streamed, last = streamed_message(http, body)
    assert streamed["content"] == message["content"] and last["finish_reason"] == "stop"
    raw = http.post(CHAT, json={**body, "separate_reasoning": False}).json()["choices"][0]["message"]["content"]
    assert raw == "</think>" + message["content"]  # the model wrote the end token; only the answer is JSON
    # unconstrained, the same bias keeps writing end tokens into the answer
    free = http.post(CHAT, json={**body, "response_format": None, "max_tokens": 4}).json()["choices"][0]
    assert free["message"]["content"] == "</think>" * 3


# thinking off: the template's own switch, or SGLang's reasoning efforts, which set it
OFF = [{"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"},
       {"reasoning": {"effort": "none"}}]


@pytest.mark.parametrize("off", OFF, ids=["template", "reasoning_effort", "reasoning"])
def test_thinking_turned_off_constrains_from_the_first_token(http, off):
    body = {"messages": HI, "max_tokens": 40, "temperature": 0, **off,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}}
    message = http.post(CHAT, json=body).json()["choices"][0]["message"]
    assert set(json.loads(message["content"])) == {"n"} and "reasoning_content" not in message


def test_include_reasoning_false_drops_the_thinking_streamed_and_not(http):
    body = {"messages": HI, "max_tokens": 8, "temperature": 0}
    full = http.post(CHAT, json=body).json()["choices"][0]["message"]
    bare = http.post(CHAT, json={**body, "include_reasoning": False}).json()["choices"][0]["message"]
    assert full["reasoning_content"] and "reasoning_content" not in bare and bare["content"] == (full["content"] or "")
    pieces: list = []
    streamed, _ = streamed_message(http, {**body, "include_reasoning": False}, pieces)
    assert not pieces and streamed["reasoning_content"] is None and (streamed["content"] or "") == bare["content"]


def test_a_reasoning_effort_other_than_none_keeps_the_thinking(http):
    body = {"messages": HI, "max_tokens": 8, "temperature": 0}
    plain, low = (http.post(CHAT, json={**body, **extra}).json()["choices"][0]["message"]
                  for extra in ({}, {"reasoning_effort": "low"}))
    assert plain["reasoning_content"] and low == plain
    body = {"model": "m", "input": "What is 2 + 2?", "max_output_tokens": 8, "temperature": 0, "store": False}
    output = http.post("/v1/responses", json={**body, "reasoning": {"effort": "none"}}).json()["output"]
    assert [item["type"] for item in output] == ["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_after_the_thinking_through_the_openai_client(client, server, stream):
    kwargs = dict(model="m", messages=HI, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0,
                  logit_bias={str(server.end_id): 100})
    if not stream:
        calls = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        args = [c.function.arguments for c in calls]
    else:
        parts: dict[int, str] = {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                parts[call.index] = parts.get(call.index, "") + (call.function.arguments or "")
        args = list(parts.values())
    assert args and all(isinstance(json.loads(a)["city"], str) for a in args)


def test_generate_separates_and_waits_for_the_thinking(http, server):
    body = {"text": "Q: 2 + 2?\nA:", "separate_reasoning": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    out = http.post("/generate", json=body).json()
    assert out["text"] == "" and out["reasoning_text"]
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) > 2 and "".join(c["text"] for c in chunks) == ""
    assert "".join(c["reasoning_text"] or "" for c in chunks) == out["reasoning_text"]
    assert sum((c["output_ids"] for c in chunks), []) == out["output_ids"]
    plain = {"text": "Q: 3 + 4?\nA:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    whole = http.post("/generate", json=plain).json()
    with http.stream("POST", "/generate", json={**plain, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == whole["text"] and len(chunks) > 2
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    constrained = {"text": "Q: 2 + 2?\nA:", "require_reasoning": True, "separate_reasoning": True,
                   "sampling_params": {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(SCHEMA),
                                       "logit_bias": {str(server.end_id): 100}}}
    out = http.post("/generate", json=constrained).json()
    assert set(json.loads(out["text"])) == {"n"} and out["reasoning_text"] is None
    raw = http.post("/generate", json={**constrained, "separate_reasoning": False}).json()
    assert raw["text"] == "</think>" + out["text"] and "reasoning_text" not in raw
    alone = http.post("/generate", json={**constrained, "require_reasoning": False, "separate_reasoning": False})
    assert set(json.loads(alone.json()["text"])) == {"n"}  # without the wait: JSON from the first token, no end token
    split = http.post("/separate_reasoning",
                      json={"text": "<think>a plan</think>\n\nfour", "reasoning_parser": "qwen3"})
    assert split.json() == {"text": "four", "reasoning_text": "a plan"}
    bad = http.post("/separate_reasoning", json={"text": "x", "reasoning_parser": "nope"})
    assert bad.status_code == 400 and "qwen3" in bad.json()["error"]["message"]


def test_the_frontend_streams_from_a_server_that_sends_new_text_only(server):
    import radixlm.lang as rl

    endpoint = rl.RuntimeEndpoint(server.url)
    assert endpoint.streams_incrementally()  # read off /server_info

    @rl.function
    def answer(s):
        s += "Q: 5 + 5?\nA:" + rl.gen("x", max_tokens=8, ignore_eos=True)

    whole = answer.run(backend=endpoint, temperature=0)["x"]
    pieces = list(answer.run(backend=endpoint, stream=True, temperature=0).text_iter("x"))
    assert len(pieces) > 1 and "".join(pieces) == whole


def test_responses_put_the_thinking_in_a_reasoning_item(http):
    body = {"model": "m", "input": "What is 2 + 2?", "max_output_tokens": 8, "temperature": 0, "store": False}
    output = http.post("/v1/responses", json=body).json()["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    thought = output[0]["content"][0]["text"]
    assert thought and output[1]["content"][0]["text"] == ""
    deltas, final = [], None
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "response.reasoning_text.delta":
                    deltas.append(event["delta"])
                elif event["type"] in ("response.completed", "response.incomplete"):
                    final = event["response"]
    assert "".join(deltas) == thought
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == thought
