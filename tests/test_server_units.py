"""Server pieces that need no model: every cross-process message round-trips through the codec,
tool-call constraints and parsing, OpenAI request validation, error bodies."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.request.req import FinishReason, StepOutput
from radixlm.server import messages as m
from radixlm.server import tool_calls, tool_stream
from radixlm.server.common import NATIVE_NAMES, OPENAI_NAMES, api_error
from radixlm.server.errors import APIError
from radixlm.server.openai_convert import chat_constraint
from radixlm.server.openai_models import ChatCompletionRequest, CompletionRequest, parse_request

STEP = StepOutput("r1", [5, 6], FinishReason("stop", matched="END"), 3, 2, 1, input_logprobs=[(None, 1), (-0.5, 2)],
                  output_logprobs=[(-0.1, 5), (float("-inf"), 6)], output_top_logprobs=[[(-0.1, 5)], [(-1.0, 7)]])
SAMPLES = {
    m.GenerateReq: m.GenerateReq("r1", [1, 2, 3], SamplingParams(stop=["x"], json_schema={"type": "object"}, n=1,
                                                                 logit_bias={"7": -2}, stop_regex=r"\d",
                                                                 min_new_tokens=2,
                                                                 sampling_seed=2**64 - 1),
                                 return_logprob=True, logprob_start_len=1, top_logprobs_num=2, stream=True),
    m.AbortReq: m.AbortReq(None),
    m.ControlReq: m.ControlReq(3, "flush_cache"),
    m.ShutdownReq: m.ShutdownReq("bye"),
    m.TokenBatch: m.TokenBatch([STEP, StepOutput("r2", [], None, 1, 0, 0)],
                               new_requests=[m.DetokParams("r1", ["END"], False, True, incremental=False)],
                               stats=m.SchedulerStats(1, 2, 3, 4, 5, 6, 7, 8, 9)),
    m.ControlReply: m.ControlReply(4, ok=True, value={"cache": {"hit_rate": 0.5}, "free_slots": 10}),
    m.TextBatch: m.TextBatch([m.TextOut("r1", "hé", [5], FinishReason("abort", message="m", code=400), 3, 1, 0,
                                        output_logprobs=[(-0.2, 5)], input_top_logprobs=[None, [(-0.1, 3)]],
                                        queue_time=0.5)], stats=None),
}


@pytest.mark.parametrize("kind", m.MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_every_message_round_trips(kind):
    msg = SAMPLES[kind]
    back = m.decode(m.encode(msg))
    assert type(back) is kind
    if kind is m.TokenBatch:  # -inf survives msgpack
        assert back.outputs[0].output_logprobs[1][0] == float("-inf")
        back.outputs[0].output_logprobs[1] = msg.outputs[0].output_logprobs[1] = (0.0, 6)
    assert back == msg


def test_decode_rejects_foreign_bytes():
    with pytest.raises(msgspec.DecodeError):
        m.decode(b"\x80\x04not msgpack of ours")
    with pytest.raises(msgspec.ValidationError):
        m.decode(msgspec.msgpack.encode({"type": "Nope"}))
    with pytest.raises(msgspec.ValidationError):  # a SamplingParams that fails its own validation
        bad = msgspec.msgpack.encode({"type": "GenerateReq", "rid": "r", "input_ids": [1], "params": {"top_p": 5}})
        m.decode(bad)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_constraints():
    named = tool_calls.constraint([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, True)
    assert json.loads(named["json_schema"]) == WEATHER["function"]["parameters"]
    required = json.loads(tool_calls.constraint([WEATHER, TIME], "required", True)["json_schema"])
    assert required["type"] == "array" and len(required["items"]["anyOf"]) == 2
    single = json.loads(tool_calls.constraint([WEATHER], "required", False)["json_schema"])
    assert single["properties"]["name"] == {"const": "get_weather"}
    tag = json.loads(tool_calls.constraint([WEATHER, TIME], "auto", True)["structural_tag"])
    assert tag["triggers"] == ["<tool_call>"]
    assert [s["begin"] for s in tag["structures"]][1] == '<tool_call>\n{"name": "get_time", "arguments": '
    assert tag["structures"][1]["schema"] == tool_calls.NO_PARAMETERS  # no parameters: OpenAI reads it as none
    assert tag["structures"][0]["schema"]["additionalProperties"] is False  # closed, as json_schema constraints are


def test_tool_call_parsing():
    """tool_stream.split: what a finished output's message holds, exactly what streaming it delivered;
    a call cut off by max_tokens is still a call (its arguments as far as they came)."""
    content, calls = tool_stream.split('{"city": "Paris"}', [WEATHER], {"function": {"name": "get_weather"}})
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    content, calls = tool_stream.split('[{"name": "get_time", "arguments": {}}]', [WEATHER, TIME], "required")
    assert content is None and [c.name for c in calls] == ["get_time"]
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tool_stream.split(text, [WEATHER], "auto")
    assert content == "Let me check." and json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert tool_stream.split("just text", [WEATHER], "auto") == ("just text", [])
    content, calls = tool_stream.split('<tool_call>\n{"name": "get_weather", "argu', [WEATHER], "auto")
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", "")]
    _, calls = tool_stream.split('{"city": "Par', [WEATHER], {"function": {"name": "get_weather"}})
    assert calls[0].arguments == '{"city": "Par'


def test_streamed_auto_calls_hold_back_the_opener():
    parser = tool_stream.CallParser([WEATHER], "auto")
    deltas = [d for piece in ["Sure", ", one moment <tool", "_call>\n{\"name\": \"get_weather\", ",
                              '"arguments": {"city": "Rome"}}\n</tool_call>'] for d in parser.feed(piece)]
    deltas += parser.finish()
    assert "".join(d.get("content") or "" for d in deltas) == "Sure, one moment"  # as the whole answer has it
    (call,) = parser.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    plain = tool_stream.CallParser([WEATHER], "auto")
    assert "".join(d.get("content") or "" for d in plain.feed("a <b") + plain.feed("<tool") + plain.finish()) == \
        "a <b<tool"


def test_tools_system_prompt_lists_signatures():
    text = tool_calls.tools_system_prompt([WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER["function"]) in text and "<tool_call>" in text


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": True}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "bogus": 1}, "bogus"),
])
def test_chat_request_validation_names_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_request(ChatCompletionRequest, body)
    assert e.value.status == 400 and e.value.param == param and param.split(".")[-1] in e.value.message


def test_chat_request_accepts_ints_for_floats_and_tool_choice_checks():
    req = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "temperature": 0})
    assert req.temperature == 0
    bad = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                                "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    with pytest.raises(APIError, match="nope"):
        bad.tool_mode()
    both = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER],
                                                 "tool_choice": "required", "response_format": {"type": "json_object"}})
    with pytest.raises(APIError, match="cannot be combined"):
        chat_constraint(both, both.tool_mode())
    assert parse_request(CompletionRequest, {"prompt": [[1, 2], [3]]}).prompt == [[1, 2], [3]]


def test_typed_errors_keep_their_field_under_each_apis_name():
    e = RequestError("max_new_tokens", "must be >= 0, got -1", section="sampling_params")
    openai_error = api_error(e, OPENAI_NAMES)
    assert openai_error.status == 400 and openai_error.param == "max_tokens"
    assert openai_error.message == "max_tokens must be >= 0, got -1"
    assert api_error(e, NATIVE_NAMES).param == "sampling_params.max_new_tokens"
    assert api_error(RequestError("prompt", "is empty"), NATIVE_NAMES).param == "text"
    body = APIError(503, "busy", code="queue_full").body()
    assert body == {"error": {"message": "busy", "type": "service_unavailable_error", "param": None,
                              "code": "queue_full"}}


def test_cli_serve_help_lists_every_option(capsys):
    from radixlm.server import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--port", "--api-key", "--max-queued-requests", "--max-request-bytes"):
        assert flag in out


def test_the_detokenizer_child_decodes_without_torch_or_transformers(tmp_path):
    """The detokenizer runs with torch's import blocked (server/torch_free.py) and, handed the
    tokenizer's decoder (runtime/output/plain_decoder.py), never imports transformers: it decodes a
    stream as transformers' tokenizer does. Without a decoder it loads that tokenizer, still without torch."""
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model
    from radixlm.runtime.output.detokenizer import IncrementalDetokenizer
    from radixlm.runtime.output.plain_decoder import decoder_spec
    from radixlm.server.torch_free import CHILD_MODULES

    assert "radixlm.server.detokenizer_process" in CHILD_MODULES
    folder = str(resolve_model("smollm2-135m").folder)
    tokenizer = load_tokenizer(folder)
    spec = decoder_spec(tokenizer)
    assert spec is not None
    ids = tokenizer.encode("Héllo, wörld! 日本語 <|im_end|> done\n  spaced")
    here = IncrementalDetokenizer(tokenizer, [])
    want = [here.add([i], None) for i in ids]
    (tmp_path / "decoder.json").write_text(spec, encoding="utf-8")
    for decoder in (tmp_path / "decoder.json", None):
        code = f"""
import json, sys
sys.modules["torch"] = None
from radixlm.server.detokenizer_process import IncrementalDetokenizer, PlainDecoder
decoder = {str(decoder)!r}
if decoder != "None":
    tokenizer = PlainDecoder(open(decoder, encoding="utf-8").read())
else:
    from radixlm.runtime.executor.loader import load_tokenizer
    tokenizer = load_tokenizer({folder!r})
detok = IncrementalDetokenizer(tokenizer, [])
print(json.dumps({{"pieces": [detok.add([i], None) for i in {ids!r}], "transformers": "transformers" in sys.modules}}))
"""
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout)
        assert got["pieces"] == want and got["transformers"] == (decoder is None)


@pytest.mark.parametrize(("raised", "exit_code"), [("", 0), ("3", 3), ("'a message'", 1)])
def test_a_child_that_ends_keeps_its_exit_code_atexit_handlers_and_output(tmp_path, raised, exit_code):
    """child_main skips the interpreter's finalization, not what a process owes on its way out."""
    (tmp_path / "ending_child.py").write_text(f"""
import atexit, pathlib
def main(path):
    atexit.register(pathlib.Path(path).write_text, "atexit ran")
    print("buffered output", end="")
    if {bool(raised)}:
        raise SystemExit({raised or None})
""")
    mark = tmp_path / "mark"
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from radixlm.server import child_main; " \
           f"child_main.run('ending_child:main', {str(mark)!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == exit_code, out.stderr[-2000:]
    assert out.stdout == "buffered output"
    assert mark.read_text() == "atexit ran"
    assert ("a message" in out.stderr) == (raised == "'a message'")


@settings(max_examples=examples(60), deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=24), special=st.lists(st.sampled_from([0, 1, 2]), max_size=3),
       at=st.integers(0, 24), skip=st.booleans())
def test_the_plain_decoder_decodes_as_transformers(ids, special, at, skip):
    """Any ids, special tokens among them, partial UTF-8 sequences included: the decoder the detokenizer
    gets decodes them as transformers' tokenizer does, with special tokens skipped or not."""
    from radixlm.runtime.output.plain_decoder import PlainDecoder

    tokenizer, decoder = _plain_decoder()
    ids = ids[:at] + special + ids[at:]
    assert decoder.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert isinstance(decoder, PlainDecoder)


@functools.cache
def _plain_decoder():
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model
    from radixlm.runtime.output.plain_decoder import PlainDecoder, decoder_spec

    tokenizer = load_tokenizer(str(resolve_model("smollm2-135m").folder))
    return tokenizer, PlainDecoder(decoder_spec(tokenizer))


def test_no_decoder_where_transformers_decodes_otherwise(monkeypatch):
    """A tokenizer whose decode does more than the Rust decode (spaces cleaned up after it, here on
    a tokenizer that cleans even BPE output) gets no decoder: the detokenizer loads transformers' then."""
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model
    from radixlm.runtime.output.plain_decoder import decoder_spec

    tokenizer = load_tokenizer(str(resolve_model("smollm2-135m").folder))
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    assert tokenizer.decode(tokenizer.encode("Hello , world .")) == "Hello, world."
    assert decoder_spec(tokenizer) is None


@pytest.mark.parametrize("finish", [FinishReason("length", matched=None), FinishReason("stop", matched=" out")])
def test_a_whole_answer_decoded_once_equals_the_streamed_one(finish):
    """Engine.generate without streaming decodes only at the finish (`incremental=False`): the answer is
    the streamed pieces joined, stop string cut, multi-byte characters whole, whatever the steps' sizes."""
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model
    from radixlm.runtime.output.detokenizer import IncrementalDetokenizer

    tokenizer = load_tokenizer(str(resolve_model("smollm2-135m").folder))
    ids = tokenizer.encode("Héllo, wörld! 日本語 done\n  spaced out")
    for size in (1, 3, len(ids)):
        steps = [ids[i : i + size] for i in range(0, len(ids), size)]
        streamed, whole = (IncrementalDetokenizer(tokenizer, [" out", "ut!"], incremental=inc) for inc in (True, False))
        pieces = [streamed.add(s, finish if k == len(steps) - 1 else None) for k, s in enumerate(steps)]
        quiet = [whole.add(s, finish if k == len(steps) - 1 else None) for k, s in enumerate(steps)]
        assert quiet[:-1] == [""] * (len(steps) - 1) and quiet[-1] == "".join(pieces)
        assert quiet[-1].endswith(" spaced" if finish.matched else " spaced out") and "日本語" in quiet[-1]
