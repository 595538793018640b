"""Tool calls in each family's own format (--tool-call-parser hermes | llama3 | mistral | auto): the
format read off a chat template, the prompt and history written in it, the "auto" grammar that opens
a call where the model writes the format's opener, and the reader that streams calls back, whose
deltas add up to the whole answer's however the output is cut."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.constrained import create_grammar_backend
from radixlm.server import tool_calls, tool_stream
from radixlm.server.tool_calls import HERMES, LLAMA3, MISTRAL, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


class Tok:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize("template,fmt", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", HERMES),  # names none: the default
    ("...<tool_call>\n{{ tool_call | tojson }}\n</tool_call>...", HERMES),
    ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}',
     LLAMA3),
    ("{{- '<|python_tag|>' + tool_call.name }}", LLAMA3),
    ("{{- '[TOOL_CALLS]' + tool_calls | tojson }}", MISTRAL),
    (None, HERMES),
])
def test_auto_reads_the_format_off_the_template(template, fmt):
    assert tool_format("auto", Tok(template)) is fmt
    assert tool_format(None, Tok(template)) is fmt
    assert tool_format("mistral", Tok(template)) is MISTRAL  # a named parser wins


@pytest.mark.parametrize("fmt,want", [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
])
def test_history_and_prompt_speak_the_format(fmt, want):
    assert tool_calls.render_call("get_weather", '{"city": "Oslo"}', fmt) == want
    assert tool_stream.split(want, TOOLS, "auto", fmt)[1][0].arguments == '{"city": "Oslo"}'
    assert want.split("{", 1)[0].strip() in tool_calls.tools_system_prompt(TOOLS, fmt)
    assert f'"{fmt.args_key}"' in tool_calls.tools_system_prompt(TOOLS, fmt)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL])
def test_the_auto_grammar_opens_a_call_at_the_formats_opener(tokenizer, fmt):
    backend = create_grammar_backend("llguidance", tokenizer, len(tokenizer))
    try:
        tag = tool_calls.constraint(TOOLS, "auto", True, fmt)["structural_tag"]
        call = tool_calls.render_call("get_weather", '{"city": "Oslo"}', fmt).replace("\n</tool_call>", "")
        opener = {"llama3": '{"name": ', "mistral": "[TOOL_CALLS]"}.get(fmt.name, "<tool_call>")
        g = backend.compile("structural_tag", tag)
        assert g.accept_string("Let me look. ") and g.accept_string(opener)
        assert not g.copy().accept_string('"get_nothing"' if fmt is LLAMA3 else '\n{"name": "get_nothing"')
        rest = call[call.index(opener) + len(opener):]
        body = rest.removesuffix("]").removesuffix("}") if fmt is not HERMES else rest.removesuffix("}")
        assert g.accept_string(body), (fmt.name, body)
        assert not g.copy().accept_string(', "extra": 1')  # the arguments' schema is closed
        forced = g.jump_forward()
        assert forced is not None and forced.strip().startswith("}")
        required = json.loads(tool_calls.constraint(TOOLS, "required", True, fmt)["json_schema"])
        shape = required if fmt is LLAMA3 else required["items"]  # llama3 makes one call a turn
        assert fmt.args_key in shape["anyOf"][0]["properties"]
    finally:
        backend.shutdown()


def test_llama3_and_mistral_outputs():
    content, calls = tool_stream.split('{"name": "get_weather", "parameters": {"city": "Paris"}}', TOOLS, "auto",
                                       LLAMA3)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                                        {"city": "Paris"})]
    assert tool_stream.split('Use {"name": "nope"} here', TOOLS, "auto", LLAMA3) == ('Use {"name": "nope"} here', [])
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", ' \
           '"arguments": {}}]'
    content, calls = tool_stream.split(text, TOOLS, "auto", MISTRAL)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[1].arguments == "{}"
    assert tool_stream.split("[TOOL_CALLS] no list", TOOLS, "auto", MISTRAL) == ("[TOOL_CALLS] no list", [])
    required = tool_stream.split('{"name": "get_time", "parameters": {}}', TOOLS, "required", LLAMA3)
    assert required[1][0].name == "get_time"


CALLS = {
    HERMES: ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "<tool_call>", "<tool"],
    LLAMA3: ['{"name": "get_weather", "parameters": {"city": "Oslo"}}', '{"name": "get_time", "parameters": {}}',
             '{"name"', '{"na', '{"name": "other"}'],
    MISTRAL: ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
              '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, '
              '{"name": "get_weather", "arguments": {"city": "x"}}]',
              "[TOOL_CALLS]", "[TOOL_", "[TOOL_CALLS][", "]"],
}
WORDS = ["Sure", " ", "\n", "let me check.", "{", "}", "[", "é"]


@settings(max_examples=examples(300), deadline=None)
@given(fmt=st.sampled_from([HERMES, LLAMA3, MISTRAL]), data=st.data())
def test_streamed_calls_add_up_to_the_whole_answer(fmt, data):
    parts = data.draw(st.lists(st.sampled_from(WORDS + CALLS[fmt]), max_size=8))
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parser = tool_stream.CallParser(TOOLS, "auto", fmt)
    content, args, names = "", {}, {}
    for delta in [d for a, b in zip([0, *cuts], [*cuts, len(text)]) for d in parser.feed(text[a:b])] + parser.finish():
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            names.setdefault(call["index"], call["function"].get("name"))
            args[call["index"]] = args.get(call["index"], "") + call["function"].get("arguments", "")
    whole_content, calls = tool_stream.split(text, TOOLS, "auto", fmt)
    assert (content or None if calls else content) == whole_content
    assert [names[i] for i in sorted(names)] == [c.name for c in calls]
    assert [args[i] for i in sorted(args)] == [c.arguments for c in calls]


@pytest.fixture(scope="module")
def llama3_server(make_tiny_model):
    from radixlm.server import launch_server

    handle = launch_server(model=str(make_tiny_model()), port=0, tool_call_parser="llama3", max_total_tokens=2048,
                           max_running_requests=4, log_level="warning")
    yield handle
    handle.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_a_llama3_call_through_the_openai_client(llama3_server, stream):
    import openai

    client = openai.OpenAI(base_url=llama3_server.url + "/v1", api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[tool],
                  tool_choice="required", max_tokens=60, temperature=0)
    if not stream:
        calls = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        got = [(c.function.name, c.function.arguments) for c in calls]
    else:
        parts: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = parts.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
        got = [tuple(v) for _, v in sorted(parts.items())]
    # llama3 makes one call a turn: {"name": ..., "parameters": ...}, the arguments read from "parameters"
    assert len(got) == 1 and got[0][0] == "get_weather" and isinstance(json.loads(got[0][1])["city"], str)
