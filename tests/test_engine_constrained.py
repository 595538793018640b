"""Grammar-constrained generation through the Engine (issue: constrained decoding checks)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixlm.runtime import Engine

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 20},
        "customer_age_in_years": {"type": "integer", "minimum": 0, "maximum": 120},
        "is_premium_member": {"type": "boolean"},
    },
    "required": ["customer_full_name", "customer_age_in_years", "is_premium_member"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
EBNF = 'root ::= "answer: " ("yes" | "no") "."'


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.apply_chat_template([{"role": "user", "content": "Describe a customer as JSON."}])


def outputs_for(engine, prompt, constraint: dict, seeds=(None, 1, 2)):
    outs = []
    for seed in seeds:
        p = {"max_new_tokens": 96, **constraint}
        p.update({"temperature": 0} if seed is None else {"temperature": 1.0, "sampling_seed": seed})
        out = engine.generate(prompt, p)
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        outs.append(out["text"])
    return outs


def test_json_schema_greedy_and_sampled_validate(engine, prompt):
    for text in outputs_for(engine, prompt, {"json_schema": json.dumps(PERSON)}):
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_fullmatch(engine, prompt):
    for text in outputs_for(engine, prompt, {"regex": PHONE}):
        assert re.fullmatch(PHONE, text), text


def test_ebnf_parses(engine, prompt):
    for text in outputs_for(engine, prompt, {"ebnf": EBNF}):
        assert re.fullmatch(r"answer: (yes|no)\.", text), text


def test_mixed_batch_same_as_alone(engine, prompt):
    plain = engine.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    params = [{"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(PERSON)},
              {"temperature": 0, "max_new_tokens": 20},
              {"temperature": 0, "max_new_tokens": 20, "regex": PHONE}]
    prompts = [prompt, plain, prompt]
    alone = [engine.generate(p, sp)["output_ids"] for p, sp in zip(prompts, params)]
    together = [o["output_ids"] for o in engine.generate(prompts, params)]
    assert together == alone


def test_jump_forward_fewer_passes_same_validity(smollm_folder, prompt):
    results = {}
    for disable in (False, True):
        # fp16: rows that move only in their last bits between the two schedules (int4's move more)
        with Engine(model=str(smollm_folder), quantization="fp16", max_total_tokens=4096,
                    disable_jump_forward=disable, log_level="warning") as e:
            before = e.get_server_info()["forward_passes"]
            out = e.generate(prompt, {"temperature": 0, "max_new_tokens": 96, "json_schema": json.dumps(PERSON)})
            jsonschema.validate(json.loads(out["text"]), PERSON)
            results[disable] = (e.get_server_info()["forward_passes"] - before, out)
    (on_passes, on), (off_passes, off) = results[False], results[True]
    assert on["meta_info"]["jump_forward_tokens"] > 0 and off["meta_info"]["jump_forward_tokens"] == 0
    assert on_passes < off_passes
    assert json.loads(on["text"]).keys() == json.loads(off["text"]).keys()


@pytest.mark.parametrize("constraint,needle", [
    ({"regex": "[a-"}, "regex"),
    ({"json_schema": "{not json"}, "json"),
    ({"json_schema": json.dumps({"$ref": "#/definitions/missing"})}, "json_schema"),
])
def test_bad_spec_fails_only_that_request(engine, prompt, constraint, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(prompt, constraint)
    good = {"temperature": 0, "max_new_tokens": 8}
    outs = engine.generate([prompt, prompt], [constraint, good])
    assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert needle.lower() in outs[0]["meta_info"]["finish_reason"]["message"].lower()
    assert outs[1]["output_ids"] == engine.generate(prompt, good)["output_ids"]


def test_outlines_backend_regex_and_schema(smollm_folder, prompt):
    with Engine(model=str(smollm_folder), max_total_tokens=4096, grammar_backend="outlines",
                log_level="warning") as e:
        out = e.generate(prompt, {"temperature": 0, "max_new_tokens": 32, "regex": PHONE})
        assert re.fullmatch(PHONE, out["text"])
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                  "required": ["name"], "additionalProperties": False}
        out = e.generate(prompt, {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(schema)})
        jsonschema.validate(json.loads(out["text"]), schema)


def test_allowed_token_ids_sample_only_the_set(engine, prompt):
    """vLLM's allowed_token_ids: the greedy choice among the set is the one a +100 logit_bias on the set
    makes; sampled rows stay inside it too; a batch's other rows are not touched; with a grammar the two
    masks intersect (and the grammar may still end)."""
    tok = engine.tokenizer
    words = [tok.encode(w, add_special_tokens=False)[0] for w in (" yes", " no", " maybe")]
    greedy = {"temperature": 0, "max_new_tokens": 6}
    restricted = engine.generate(prompt, {**greedy, "allowed_token_ids": words})
    biased = engine.generate(prompt, {**greedy, "logit_bias": {t: 100 for t in words}})
    assert restricted["output_ids"] == biased["output_ids"] and len(restricted["output_ids"]) == 6  # no EOS in set
    plain = engine.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    batch = engine.generate([prompt, plain, prompt], [
        {"temperature": 1.0, "max_new_tokens": 12, "allowed_token_ids": words, "sampling_seed": 3},
        {**greedy, "max_new_tokens": 12}, {**greedy, "allowed_token_ids": words}])
    assert set(batch[0]["output_ids"]) <= set(words) and len(set(batch[0]["output_ids"])) > 1
    assert batch[1]["output_ids"] == engine.generate(plain, {**greedy, "max_new_tokens": 12})["output_ids"]
    assert batch[2]["output_ids"] == restricted["output_ids"]
    ones_and_twos = [tok.encode(d, add_special_tokens=False)[0] for d in "12"]
    both = engine.generate(prompt, {**greedy, "max_new_tokens": 8, "regex": "[0-9]{3}",
                                    "allowed_token_ids": ones_and_twos})
    assert re.fullmatch("[12]{3}", both["text"]) and both["meta_info"]["finish_reason"]["type"] == "stop"
    with pytest.raises(ValueError, match="regex under allowed_token_ids admits no output"):
        engine.generate(prompt, {**greedy, "regex": "[a-z]+", "allowed_token_ids": ones_and_twos})
    for bad, needle in [([], "non-empty"), ([len(tok) + 10**6], "not a token id"), ("1", "non-empty")]:
        with pytest.raises(ValueError, match=needle):
            engine.generate(prompt, {**greedy, "allowed_token_ids": bad})
    with pytest.raises(ValueError, match="token_healing"):
        engine.generate(prompt, {**greedy, "allowed_token_ids": words, "token_healing": True})


def test_bad_words_are_never_completed(engine):
    """vLLM's bad_words: a one-token word never appears, a longer one never gets its last token after
    the others; the answer is the free one up to where a word would have been written."""
    question = engine.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    greedy = {"temperature": 0, "max_new_tokens": 30}
    free = engine.generate(question, greedy)["text"]
    assert "Paris" in free and "capital of France" in free
    # (word, what of it is still written: all its tokens but the last)
    for word, kept in (("Paris", ""), ("capital of France", "capital of")):
        text = engine.generate(question, {**greedy, "bad_words": [word]})["text"]
        assert word not in text and text.startswith(free[: free.index(word)] + kept)
    both = engine.generate([question, question], [{**greedy, "bad_words": ["Paris"]}, greedy])
    assert "Paris" not in both[0]["text"] and both[1]["text"] == free
    for bad, needle in [([""], "non-blank"), (["x" * 200], "longer than"), ("Paris", "list")]:
        with pytest.raises(ValueError, match=needle):
            engine.generate(question, {**greedy, "bad_words": bad})
