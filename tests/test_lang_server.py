"""The language against a real RadixLM server started with `radixlm.lang.Runtime` (SmolLM2, CPU):
API speculative execution over the OpenAI API equals the plain result at temperature 0, token
healing and JSON schemas through /generate, text in logprobs. One server for the module."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

import radixlm.lang as rl

pytestmark = pytest.mark.slow
pytest.importorskip("openai")

MODEL = "smollm2-135m"
# allOf + oneOf (disjoint branches) + patternProperties + $ref: the default backend enforces it all
SCHEMA = {
    "$defs": {"pos": {"type": "integer", "minimum": 1, "maximum": 9}},
    "type": "object",
    "properties": {"id": {"$ref": "#/$defs/pos"},
                   "kind": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}},
    "patternProperties": {"^x_": {"type": "boolean"}},
    "additionalProperties": False,
    "allOf": [{"required": ["id"]}, {"required": ["kind"]}],
}


@pytest.fixture(scope="module")
def runtime():
    # float32, as the shared `engine` its healed answer is compared with
    rt = rl.Runtime(model_path=MODEL, quantization="none", max_total_tokens=8192, log_level="warning")
    yield rt
    rt.shutdown()


def test_runtime_is_a_backend_with_sglangs_helpers(runtime):
    assert rl.as_backend(runtime) is runtime.endpoint
    out = json.loads(runtime.generate("Hello", {"max_new_tokens": 2, "temperature": 0}))
    assert out["meta_info"]["completion_tokens"] == 2
    assert runtime.get_server_info()["model_path"]

    @rl.function
    def prog(s):
        s += "The sky is" + rl.gen("x", max_tokens=4, temperature=0, return_logprob=True,
                                   return_text_in_logprobs=True)

    state = prog.run(backend=runtime)
    entries = state.get_meta_info("x")["output_token_logprobs"]
    tokenizer = runtime.get_tokenizer()
    assert len(entries) == 4 and all(e[2] == tokenizer.decode([e[1]]) for e in entries)
    assert "".join(e[2] for e in entries) == state["x"]


def two_lines(s):
    s += rl.user("Name three fruits, one per line, nothing else.")
    s += rl.assistant(rl.gen("first", stop="\n") + "\n" + rl.gen("second", stop="\n"))


def test_chat_speculation_equals_the_plain_program(runtime):
    chat = rl.OpenAI(MODEL, base_url=runtime.url + "/v1")
    spec = rl.function(two_lines, num_api_spec_tokens=48).run(backend=chat, temperature=0)
    plain = rl.function(two_lines).run(backend=runtime, temperature=0)  # the same program, natively
    assert spec.error() is None and (spec["first"], spec["second"]) == (plain["first"], plain["second"])
    assert spec["first"] and spec["second"]
    assert chat.token_usage.completion_tokens > 0 and chat.token_usage.prompt_tokens > 0
    refused = rl.function(two_lines).run(backend=chat, temperature=0)
    assert "num_api_spec_tokens" in str(refused.error())


def test_completion_speculation_equals_the_plain_program(runtime):
    def qa(s):
        s += "Q: What is the capital of France?\nA:" + rl.gen("a", stop="\n")
        s += "\nQ: What is the capital of Italy?\nA:" + rl.gen("b", stop="\n")

    backend = rl.OpenAI(MODEL, base_url=runtime.url + "/v1", is_chat_model=False)
    spec = rl.function(qa, num_api_spec_tokens=64).run(backend=backend, temperature=0)
    plain = rl.function(qa).run(backend=backend, temperature=0)
    assert spec.error() is None and spec.text() == plain.text() and spec["a"]


def test_token_healing_through_generate(runtime, engine):
    body = {"text": "The capital of France is ", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    plain = httpx.post(runtime.generate_url, json=body, timeout=120).json()
    body["sampling_params"]["token_healing"] = True
    healed = httpx.post(runtime.generate_url, json=body, timeout=120).json()
    local = engine.generate(body["text"], body["sampling_params"])
    assert healed["text"] == local["text"] and healed["text"] != plain["text"]
    assert not healed["text"].startswith(" ")

    @rl.function
    def week(s, healing):
        s += "A week has " + rl.gen_int("days", max_tokens=16, temperature=0, token_healing=healing)

    short = week.run(healing=True, backend=runtime)["days"]
    assert short.isdigit() and len(short) <= 3


def test_json_schema_is_enforced_or_refused_through_generate(runtime):
    prompts = ["Give a JSON record: ", "Describe item 3 as JSON: ", "A JSON object with an id: "]
    for prompt in prompts:
        body = {"text": prompt, "sampling_params": {"json_schema": json.dumps(SCHEMA), "temperature": 0,
                                                    "max_new_tokens": 48}}
        r = httpx.post(runtime.generate_url, json=body, timeout=120)
        if r.status_code == 400:  # refused: names the keyword it cannot enforce
            assert any(k in r.text for k in ("allOf", "oneOf", "patternProperties", "$ref")), r.text
            continue
        out = r.json()
        assert r.status_code == 200 and out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
    bad = {"type": "integer", "minimum": 1, "maximum": 3, "not": {"enum": [1, 2, 3]}}  # unsatisfiable
    body = {"text": "JSON: ", "sampling_params": {"json_schema": json.dumps(bad), "max_new_tokens": 48,
                                                  "temperature": 0}}
    r = httpx.post(runtime.generate_url, json=body, timeout=120)
    assert r.status_code == 400 and "not" in r.json()["error"]["message"]
