"""Real clients against one real server (SmolLM2, loopback), one test per client fix of issue 22:
lm-evaluation-harness's local-completions (multiple-choice loglikelihoods), the openai client,
instructor's partial streaming, LangChain, LiteLLM and SGLang's frontend."""

from __future__ import annotations

import functools
import json
import operator
import re

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}  # open: JSON Schema would allow other keys
NEWS = {"type": "function", "function": {"name": "get_news", "description": "Today's news"}}  # no parameters
NAMED = {"type": "function", "function": {"name": "get_weather"}}  # tool_choice


def few_shot(name: str, args: list[dict], content: str | None = None) -> list[dict]:
    """Two earlier turns in which the assistant called `name` with `args`, then a third question:
    SmolLM2-135M follows the pattern and calls the tool in "auto" mode."""
    messages: list[dict] = []
    for i, (city, arg) in enumerate(zip(["Oslo", "Rome"], args)):
        call = {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arg)}}
        messages += [{"role": "user", "content": f"What's up in {city}?"},
                     {"role": "assistant", "content": content and f"{content} {city}.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": "ok"},
                     {"role": "assistant", "content": "Done."}]
    return messages + [{"role": "user", "content": "What's up in Paris?"}]


# extra keys in the history ("time") that WEATHER's schema does not list
WEATHER_SHOTS = few_shot("get_weather", [{"city": "Oslo", "time": "now"}, {"city": "Rome", "time": "today"}],
                         content="Checking")


@pytest.fixture(scope="module")
def server():
    from radixlm.server import launch_server

    # float32: tests here compare logprobs across requests answered on other cache states, which int4's
    # bfloat16 rows move by a few hundredths (README, --quantization)
    handle = launch_server(model="smollm2-135m", port=0, context_length=2048, max_total_tokens=8192,
                           max_running_requests=8, max_queued_requests=16, quantization="none", log_level="warning")
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def input_logprobs(http: httpx.Client, ids: list[int]) -> list:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}
    return http.post("/generate", json=body).json()["meta_info"]


def streamed_calls(chunks) -> tuple[str, dict[int, list], list]:
    """(content, {index: [id, name, arguments]}, the tool-call deltas in order) of a chat stream."""
    content, calls, deltas = "", {}, []
    for c in chunks:
        if not c.choices:
            continue
        content += c.choices[0].delta.content or ""
        for tc in c.choices[0].delta.tool_calls or []:
            deltas.append(tc)
            call = calls.setdefault(tc.index, [tc.id, tc.function.name, ""])
            call[2] += tc.function.arguments or ""
    return content, calls, deltas


# --------------------------------------------------------------------------- 2: completions logprobs
def test_lm_eval_multiple_choice_scores_and_matches_generate(server, http, smollm_folder, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    docs = [{"question": "The capital of France is", "choices": ["Paris", "London", "Rome"], "label": 0},
            {"question": "Two plus two equals", "choices": ["four", "seven", "ten"], "label": 0},
            {"question": "The colour of a clear sky is", "choices": ["green", "blue", "red"], "label": 1}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tiny_mc.yaml").write_text(
        "task: radixlm_tiny_mc\ndataset_path: json\ndataset_kwargs:\n"
        f"  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n  cache_dir: {tmp_path / 'hf_cache'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_target: label\n"
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    lm = LocalCompletionsAPI(base_url=server.url + "/v1/completions", model="smollm2-135m",
                             tokenizer_backend="huggingface", tokenizer=str(smollm_folder), max_retries=1)
    out = simple_evaluate(model=lm, tasks=["radixlm_tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)),
                          log_samples=True)
    assert 0.0 <= out["results"]["radixlm_tiny_mc"]["acc,none"] <= 1.0
    samples = out["samples"]["radixlm_tiny_mc"]
    assert len(samples) == 3
    for sample in samples:
        for (context, continuation), (ll, _) in zip(sample["arguments"], sample["filtered_resps"]):
            ctx, cont = lm._encode_pair(context, continuation)
            meta = input_logprobs(http, ctx + cont)
            want = sum(e[0] for e in meta["input_token_logprobs"][len(ctx):])
            assert ll == pytest.approx(want, abs=1e-3), (context, continuation)


PROMPT = "The capital of France is"


def test_completions_echo_top_logprobs_include_the_token(client, http):
    out = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, logprobs=2, echo=True, temperature=0)
    lp = out.choices[0].logprobs
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    n = len(ids)
    assert lp.top_logprobs[0] is None and lp.token_logprobs[0] is None  # the first prompt token has none
    meta = input_logprobs(http, ids)
    for i in range(1, len(lp.tokens)):
        top = lp.top_logprobs[i]
        assert len(top) <= 3 and top[lp.tokens[i]] == lp.token_logprobs[i]  # the token itself: logprobs + 1
        if i < n:  # the prompt's rows are /generate's input_top_logprobs
            want = {http.post("/detokenize", json={"tokens": [t]}).json()["text"]: v
                    for v, t, _ in meta["input_top_logprobs"][i]}
            assert {k: top[k] for k in want} == pytest.approx(want, abs=1e-4)


def test_completions_streamed_text_offsets_continue(client):
    kwargs = dict(model="m", prompt=PROMPT, max_tokens=6, logprobs=1, echo=True, temperature=0)
    out = client.completions.create(**kwargs)
    lp = out.choices[0].logprobs
    streamed = list(client.completions.create(**kwargs, stream=True))
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset and offsets[-1] > 0
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text


# --------------------------------------------------------------------------- 3: streamed tool calls
def test_instructor_partial_streaming_in_tools_mode(server):
    instructor = pytest.importorskip("instructor")
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        unit: str

    patched = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
                                     mode=instructor.Mode.TOOLS)
    kwargs = dict(model="m", response_model=Weather, max_tokens=60, temperature=0,
                  messages=[{"role": "user", "content": "The weather in Paris, in celsius?"}])
    partials = list(patched.chat.completions.create_partial(**kwargs))
    whole = patched.chat.completions.create(**kwargs)
    assert len(partials) >= 4, "the arguments arrive in pieces, so instructor sees the object form"
    assert partials[-1].model_dump() == whole.model_dump()


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_openai_streamed_tool_calls_form_as_openai_streams_them(client, choice):
    kwargs = dict(model="m", messages=WEATHER_SHOTS, tools=[WEATHER], max_tokens=80, temperature=0,
                  tool_choice=NAMED if choice == "named" else choice)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    content, calls, deltas = streamed_calls(chunks)
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    head = deltas[0]  # id and name first, with empty arguments
    assert head.id and head.function.name == "get_weather" and head.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert len([d for d in deltas if d.function.arguments]) >= 2, "arguments arrive in several chunks"
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "tool_calls" and last.delta.content is None and not last.delta.tool_calls
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments)
                                                      for c in whole.message.tool_calls]  # byte for byte


def test_streamed_content_before_a_call_drops_whitespace_as_the_answer_does(client):
    kwargs = dict(model="m", messages=WEATHER_SHOTS, tools=[WEATHER], max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message
    content, _, _ = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert whole.content == "Checking Paris." and whole.tool_calls
    assert content == whole.content  # "Checking Paris.\n" before <tool_call> loses its newline in both


def test_langchain_streams_tool_call_chunks(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="m", temperature=0, max_tokens=60,
                        max_retries=0).bind_tools([WEATHER], tool_choice="get_weather")
    chunks = list(llm.stream("What's the weather in Oslo?"))
    assert len([c for c in chunks if any(t.get("args") for t in c.tool_call_chunks)]) >= 2
    total = functools.reduce(operator.add, chunks)
    assert total.tool_calls[0]["args"] == llm.invoke("What's the weather in Oslo?").tool_calls[0]["args"]


# --------------------------------------------------------------------------- 4: arguments follow the schema
def test_litellm_auto_tool_call_arguments_keep_to_the_schema(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # never fetch the price list
    litellm = pytest.importorskip("litellm")
    resp = litellm.completion(model="openai/m", api_base=server.url + "/v1", api_key="x", temperature=0,
                              max_tokens=80, messages=WEATHER_SHOTS, tools=[WEATHER], tool_choice="auto")
    (call,) = resp.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert set(args) <= {"city", "unit"}, "the history's 'time' key is not in the schema"
    jsonschema.validate(args, {**WEATHER["function"]["parameters"], "additionalProperties": False})


def test_tool_without_parameters_takes_none(client):
    shots = few_shot("get_news", [{"city": "Oslo"}, {"city": "Rome"}])
    for choice in ("auto", {"type": "function", "function": {"name": "get_news"}}):
        out = client.chat.completions.create(model="m", messages=shots, tools=[NEWS], tool_choice=choice,
                                             max_tokens=40, temperature=0)
        (call,) = out.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {}


# --------------------------------------------------------------------------- 6: smaller ones
def test_tokenize_counts_what_chat_feeds_the_model(client, http):
    """/tokenize of messages with tools gives the ids chat renders: the tools' section included."""
    for tools in ([WEATHER], None):
        body = {"messages": HI, **({"tools": tools} if tools else {})}
        count = http.post("/tokenize", json=body).json()["count"]
        out = client.chat.completions.create(model="m", max_tokens=1, **body)
        assert count == out.usage.prompt_tokens, tools


def test_models_retrieve_unknown_is_404(client, server):
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    assert client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).model == "smollm2-135m"  # requests stay lenient


def test_legacy_functions_answered_with_function_call(client):
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=60,
                  temperature=0, functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == "function_call" and out.message.tool_calls is None
    assert out.message.function_call.name == "get_weather" and json.loads(out.message.function_call.arguments)
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    calls = [c.choices[0].delta.function_call for c in chunks if c.choices[0].delta.function_call]
    assert calls[0].name == "get_weather" and calls[0].arguments == "" and len(calls) >= 3
    assert "".join(c.arguments for c in calls) == out.message.function_call.arguments
    assert chunks[-1].choices[0].finish_reason == "function_call"


def test_sglang_cot_decoding_reads_next_position_top_k(server, http):
    sgl = pytest.importorskip("sglang", reason="scripts/setup.sh installs PyPI sglang's frontend (--no-deps)")
    question = "Question: What is 7 times 6?\nAnswer:"

    @sgl.function
    def cot_decoding(s, k):  # the first step of SGLang's examples/frontend_language/usage/cot_decoding.py
        s += question
        step_0 = s.fork(1)[0]
        step_0 += sgl.gen("get_top_k", max_tokens=0, return_logprob=True, top_logprobs_num=k,
                          return_text_in_logprobs=True)
        s["top"] = step_0.get_meta_info("get_top_k")["output_top_logprobs"][0]

    state = cot_decoding.run(k=3, backend=sgl.RuntimeEndpoint(server.url))
    top = state["top"]
    assert len(top) == 3 and all(isinstance(text, str) for _, _, text in top)
    greedy = http.post("/generate", json={"text": question, "sampling_params": {"max_new_tokens": 1,
                                                                                  "temperature": 0}}).json()
    assert top[0][1] == greedy["output_ids"][0]


def test_chat_templates_of_sglang_and_radixlm_runtime_endpoints(server, http):
    sgl = pytest.importorskip("sglang", reason="scripts/setup.sh installs PyPI sglang's frontend (--no-deps)")
    from radixlm.lang import RuntimeEndpoint

    ours = RuntimeEndpoint(server.url).get_chat_template()
    begin, end = ours.get_prefix_and_suffix("user", [{"role": "system", "content": "x"}])
    assert (begin, end) == ("<|im_start|>user\n", "<|im_end|>\n")  # SmolLM2 speaks ChatML
    assert sgl.RuntimeEndpoint(server.url).get_chat_template().name == "default"  # guessed from the path
    chatml = sgl.RuntimeEndpoint(server.url, chat_template_name="chatml").get_chat_template()
    assert chatml.role_prefix_and_suffix["user"] == (begin, end)  # the documented remedy


def pick_one(client, **extra) -> str:
    """A greedy chat answer to "Pick one." under the request's extra (non-OpenAI) fields."""
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Pick one."}],
                                          max_tokens=30, temperature=0, extra_body=extra).choices[0].message.content


def test_vllm_guided_fields(client):
    ask = functools.partial(pick_one, client)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    jsonschema.validate(json.loads(ask(guided_json=schema)), schema)
    assert re.fullmatch(r"[0-9]{3}", ask(guided_regex=r"[0-9]{3}"))
    assert ask(guided_choice=["red (warm)", "blue?", "a.b"]) in ("red (warm)", "blue?", "a.b")
    assert ask(guided_grammar='root ::= "yes" | "no"') in ("yes", "no")
    for extra, param in [({"guided_json": schema, "response_format": {"type": "json_object"}}, "guided_json"),
                         ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
                         ({"guided_regex": "a", "regex": "b"}, "guided_regex"),
                         ({"guided_regex": "(("}, "guided_regex")]:  # refused by the grammar: named as sent
        with pytest.raises(openai.BadRequestError) as e:
            ask(**extra)
        assert e.value.body["param"] == param


HI = [{"role": "user", "content": "hi"}]


def test_vllm_add_generation_prompt(client):
    def prompt_tokens(**extra):
        out = client.chat.completions.create(model="m", messages=HI, max_tokens=1, extra_body=extra)
        return out.usage.prompt_tokens

    assert prompt_tokens(add_generation_prompt=False) < prompt_tokens(add_generation_prompt=True) == prompt_tokens()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[*HI, {"role": "assistant", "content": "Hel"}],
                                       max_tokens=1, extra_body={"add_generation_prompt": True,
                                                                 "continue_final_message": True})
    assert e.value.body["param"] == "add_generation_prompt"


def test_image_part_is_a_400_that_says_why(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert e.value.body["param"] == "messages.0.content.0.type" and "text-only" in e.value.body["message"]


def test_continuous_usage_stats(client):
    chunks = list(client.chat.completions.create(model="m", messages=HI, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == counts[-1] > 0


def test_docs_page(http):
    page = http.get("/docs")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and "<script" not in page.text
    assert "default-src 'none'" in page.headers["content-security-policy"]


def test_apply_chat_template_shows_tools(http):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = http.post("/apply_chat_template", json={"messages": messages, "tools": [WEATHER]}).json()["text"]
    assert "get_weather" in text and "<tool_call>" in text  # the tools section chat completions shows the model
    bad = http.post("/apply_chat_template", json={"messages": messages, "tools": [{"type": "function"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools.0.function"


# --------------------------------------------------------------------------- pydantic tools in every mode
def pydantic_tools():
    """Two tools as pydantic writes them (what instructor, the Agents SDK, LangChain and pydantic-ai
    send): nested and optional submodels under `$defs` with `$ref`, and a recursive model."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str | None = None

    class Leg(BaseModel):
        origin: City
        dest: City
        via: City | None = None

    class Trip(BaseModel):
        legs: list[Leg] = Field(min_length=1, max_length=2)  # bounded, so a small model ends the call

    class Node(BaseModel):
        label: str = Field(max_length=20)
        children: list[Node] = Field(default=[], max_length=2)

    tools = [{"type": "function", "function": {"name": "book", "description": "Book a trip",
                                               "parameters": Trip.model_json_schema()}},
             {"type": "function", "function": {"name": "outline", "description": "An outline as a tree",
                                               "parameters": Node.model_json_schema()}}]
    assert all("$defs" in t["function"]["parameters"] for t in tools)
    return tools, {"book": Trip, "outline": Node}


TRIP = {"legs": [{"origin": {"name": "Oslo"}, "dest": {"name": "Rome", "country": "Italy"}}]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "auto", "named"])
def test_pydantic_tools_with_refs_in_every_tool_choice(client, choice, stream):
    tools, models = pydantic_tools()
    messages = few_shot("book", [TRIP, TRIP]) if choice == "auto" else [
        {"role": "user", "content": "Book a trip from Paris to Rome."}]
    kwargs = dict(model="m", messages=messages, tools=tools, max_tokens=160, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "book"}} if choice == "named" else choice)
    if stream:
        _, streamed, _ = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        calls = [(name, args) for _, name, args in streamed.values()]
    else:
        out = client.chat.completions.create(**kwargs).choices[0]
        assert out.finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert calls
    for name, arguments in calls:
        models[name].model_validate_json(arguments)  # the nested models parse: the refs were followed


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_forced_pydantic_tool(client, stream):
    tools, models = pydantic_tools()
    flat = [{"type": "function", **t["function"]} for t in tools]
    kwargs = dict(model="m", input="Book a trip from Paris to Rome.", tools=flat, tool_choice="required",
                  max_output_tokens=160, temperature=0)
    if stream:
        with client.responses.stream(**kwargs) as events:
            out = events.get_final_response()
    else:
        out = client.responses.create(**kwargs)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls
    for call in calls:
        models[call.name].model_validate_json(call.arguments)


def test_tool_schema_errors_name_the_clients_field(client, http):
    tools, _ = pydantic_tools()
    broken = {"type": "function", "function": {"name": "broken", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}}}
    body = dict(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    for choice in ({"type": "function", "function": {"name": "broken"}}, "required", "auto"):
        r = http.post("/v1/chat/completions", json={**body, "tools": [*tools, broken], "tool_choice": choice})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools.2.function.parameters", (choice, err)
        assert "'#/$defs/Missing'" in err["message"] and "json_schema" not in err["message"], err
    # what only the grammar's compile finds is named by the tool when it is the only one, else by `tools`
    bad_pattern = {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}}}
    for listed, choice, param in [([bad_pattern], "required", "tools.0.function.parameters"),
                                  ([*tools, bad_pattern], "required", "tools"),
                                  ([*tools, bad_pattern], {"type": "function", "function": {"name": "bad"}},
                                   "tools.2.function.parameters")]:
        r = http.post("/v1/chat/completions", json={**body, "tools": listed, "tool_choice": choice})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, (choice, err)
        assert err["message"].startswith(f"invalid {param}: "), err
    flat = {"type": "function", **broken["function"]}
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4, "tools": [flat],
                                         "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.parameters", r.json()
    functions = http.post("/v1/chat/completions", json={**body, "functions": [broken["function"]],
                                                        "function_call": {"name": "broken"}})
    assert functions.json()["error"]["param"] == "functions.0.parameters"
    twice = http.post("/v1/chat/completions", json={**body, "tools": [tools[0], broken, tools[0]]})
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "tools.2.function.name", twice.text


def test_an_unreachable_length_bound_is_no_constraint(client):
    huge = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 2**70}},
        "required": ["city"]}}}
    for choice in ("required", "auto", {"type": "function", "function": {"name": "book"}}):
        out = client.chat.completions.create(model="m", messages=few_shot("book", [{"city": "Oslo"}] * 2),
                                             tools=[huge], tool_choice=choice, max_tokens=40, temperature=0)
        (call,) = out.choices[0].message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city"}, choice


# a number after every comma: "," then a JSON integer (whitespace allowed around it) then ";"
COMMA_TAG = {"type": "structural_tag", "structures": [{"begin": ",", "schema": {"type": "integer"}, "end": ";"}],
             "triggers": [","]}
AFTER_COMMAS = re.compile(r"[^,]*(,\s*-?\d+\s*;[^,]*)*(,\s*-?\d*\s*)?")  # the last structure may be cut


def test_structural_tag_response_format_and_response_format_on_completions(client, http):
    """SGLang's (and vLLM's) structural_tag response_format reaches the grammar on chat and
    completions, as response_format does on completions (vLLM's and SGLang's field)."""
    text = client.completions.create(model="m", prompt="Count: 1, 2, 3", max_tokens=12, temperature=0,
                                     extra_body={"response_format": COMMA_TAG}).choices[0].text
    assert "," in text and AFTER_COMMAS.fullmatch(text), text
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Count to ten: 1, 2,"}],
                                          max_tokens=24, temperature=0, response_format=COMMA_TAG)
    assert AFTER_COMMAS.fullmatch(chat.choices[0].message.content), chat.choices[0].message.content
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    out = client.completions.create(model="m", prompt="JSON:", max_tokens=24, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}).choices[0].text
    jsonschema.validate(json.loads(out), schema)
    short = client.chat.completions.create(model="m", messages=HI, max_tokens=24, temperature=0, response_format={
        "type": "json_schema", "schema": schema})  # SGLang's shorthand
    jsonschema.validate(json.loads(short.choices[0].message.content), schema)
    body = {"model": "m", "messages": HI, "max_tokens": 4}
    for fmt, param in [({"type": "structural_tag", "structures": COMMA_TAG["structures"]}, "response_format.triggers"),
                       ({"type": "json_object", "triggers": [","]}, "response_format.triggers"),
                       ({**COMMA_TAG, "format": {"type": "any_text"}}, "response_format.format"),
                       ({**COMMA_TAG, "at_least_one": True}, "at_least_one")]:
        r = http.post("/v1/chat/completions", json={**body, "response_format": fmt})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # xgrammar's own form: served by xgrammar; the llguidance default says which form it takes
    r = http.post("/v1/chat/completions", json={**body, "response_format": {"type": "structural_tag",
                                                                             "format": {"type": "any_text"}}})
    assert r.status_code == 400 and "SGLang's form" in r.json()["error"]["message"], r.text


def test_vllm_structured_outputs_and_request_extras(client, http, server):
    """vLLM's structured_outputs (its successor to guided_*), structural_tag, include_stop_str_in_output,
    truncate_prompt_tokens and documents do what vLLM's do; its names RadixLM cannot serve are a 400
    naming them."""
    ask = functools.partial(pick_one, client)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    jsonschema.validate(json.loads(ask(structured_outputs={"json": schema})), schema)
    assert re.fullmatch(r"[0-9]{3}", ask(structured_outputs={"regex": r"[0-9]{3}"}))
    assert ask(structured_outputs={"choice": ["red (warm)", "blue?"]}) in ("red (warm)", "blue?")
    assert ask(structured_outputs={"grammar": 'root ::= "yes" | "no"', "disable_any_whitespace": True}) in ("yes", "no")
    assert AFTER_COMMAS.fullmatch(ask(structural_tag=json.dumps(COMMA_TAG)))

    def complete(**extra):
        return client.completions.create(model="m", prompt="Count: 1, 2, 3", max_tokens=8, temperature=0, stop=[","],
                                         extra_body=extra).choices[0].text
    assert complete(include_stop_str_in_output=True) == complete(include_stop_str_in_output=False) + ","
    ids = http.post("/tokenize", json={"prompt": "The quick brown fox jumps over the lazy dog. " * 12}).json()["tokens"]
    cut = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 20})
    tail = client.completions.create(model="m", prompt=ids[-20:], max_tokens=6, temperature=0)
    assert cut.usage.prompt_tokens == 20 and cut.choices[0].text == tail.choices[0].text
    # allowed_token_ids: a classifier's answer among two tokens, streamed or not; an id past the vocabulary is a 400
    yes_no = [http.post("/tokenize", json={"prompt": w, "add_special_tokens": False}).json()["tokens"][0]
              for w in (" yes", " no")]
    answers = [client.completions.create(model="m", prompt="Is the sky blue? Answer:", max_tokens=3, temperature=t,
                                         seed=7, extra_body={"allowed_token_ids": yes_no})
               for t in (0, 1.0)]
    assert all(re.fullmatch("( yes| no){3}", a.choices[0].text) for a in answers)
    streamed = client.chat.completions.create(model="m", messages=HI, max_tokens=4, temperature=0, stream=True,
                                              extra_body={"allowed_token_ids": yes_no})
    assert re.fullmatch("( yes| no){4}", "".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
    # return_token_ids: the prompt's ids and each choice's, whole and streamed (RL clients train on them);
    # return_tokens_as_token_ids names logprob tokens by id
    ask_ids = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(model="m", prompt="Count: 1, 2, 3,", max_tokens=5, temperature=0, logprobs=1,
                                      extra_body=ask_ids).choices[0].model_dump()
    prompt_ids = http.post("/tokenize", json={"prompt": "Count: 1, 2, 3,"}).json()["tokens"]
    assert whole["prompt_token_ids"] == prompt_ids and len(whole["token_ids"]) == 5
    assert whole["logprobs"]["tokens"] == [f"token_id:{t}" for t in whole["token_ids"]]
    chunks = [c.choices[0].model_dump() for c in client.completions.create(
        model="m", prompt="Count: 1, 2, 3,", max_tokens=5, temperature=0, stream=True, extra_body=ask_ids)
        if c.choices]
    assert sum((c["token_ids"] for c in chunks), []) == whole["token_ids"]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    chat = client.chat.completions.create(model="m", messages=HI, max_tokens=6, temperature=0,
                                          extra_body=ask_ids).model_dump()
    streamed = [c.model_dump() for c in client.chat.completions.create(model="m", messages=HI, max_tokens=6,
                                                                        temperature=0, stream=True, extra_body=ask_ids)]
    assert streamed[0]["prompt_token_ids"] == chat["prompt_token_ids"] and len(chat["prompt_token_ids"]) > 5
    assert sum((c["choices"][0].get("token_ids") or [] for c in streamed if c["choices"]), []) == \
        chat["choices"][0]["token_ids"]
    # bad_words: the count goes on without the word
    count = [client.completions.create(model="m", prompt="Count: 1, 2, 3,", max_tokens=6, temperature=0,
                                       extra_body=extra).choices[0].text for extra in ({}, {"bad_words": ["4"]})]
    assert "4" in count[0] and "4" not in count[1] and count[1], count

    from radixlm.server.openai_convert import chat_template_args
    from radixlm.server.openai_models import ChatCompletionRequest

    docs = [{"title": "Fjords", "text": "Norway has many."}]
    request = ChatCompletionRequest.model_validate({"messages": HI, "documents": docs})
    assert chat_template_args(request, None, None)[1]["documents"] == docs
    body = {"model": "m", "messages": HI, "max_tokens": 2}
    for extra, param in [({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
                         ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
                         ({"structural_tag": json.dumps(COMMA_TAG), "guided_regex": "a"}, "guided_regex"),
                         ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
                         ({"bad_words": [" "]}, "bad_words"),
                         ({"chat_template": "{{ messages }}"}, "chat_template"),
                         ({"include_stop_str_in_output": True, "no_stop_trim": False}, "include_stop_str_in_output")]:
        r = http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
