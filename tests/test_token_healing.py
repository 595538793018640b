"""Token healing (runtime/request/healing.py): masks against a brute-force definition on the SmolLM2
vocabulary, composition with regex / JSON constraints, stop crossing, the text the output leaves
out, and the Engine end to end (off by default: outputs unchanged)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from radixlm.constrained import bitmask_to_bool, create_grammar_backend
from radixlm.runtime.output.detokenizer import IncrementalDetokenizer
from radixlm.runtime.output.finish import check_finish
from radixlm.runtime.request.healing import HealingGrammar, healing_vocab, plan_healing, start_healing
from radixlm.runtime.request.req import FinishReason

V = 49152


@pytest.fixture(scope="module")
def xgr(tokenizer):
    backend = create_grammar_backend("xgrammar", tokenizer, V)
    yield backend
    backend.shutdown()


def allowed(grammar, words=(V + 31) // 32) -> set[int]:
    bm = torch.zeros((1, words), dtype=torch.int32)
    grammar.fill_mask(bm, 0)
    return set(bitmask_to_bool(bm, V)[0].nonzero().flatten().tolist())


def test_mask_is_exactly_the_healing_definition(tokenizer, xgr):
    vocab = healing_vocab(tokenizer)
    table = vocab.token_bytes
    free = HealingGrammar(None, b" ", vocab)
    want = {i for i, b in enumerate(table) if b and (b.startswith(b" ") or b" ".startswith(b))}
    assert allowed(free) == want
    digits = HealingGrammar(xgr.compile("regex", "[0-9]+"), b" ", vocab)
    want = {i for i, b in enumerate(table) if b and (b == b" " or (b.startswith(b" ") and b[1:].isdigit()))}
    assert allowed(digits) == want
    # the prompt ended in " P"; the regex constrains what follows it
    word = HealingGrammar(xgr.compile("regex", "(aris|ar)!"), b" P", vocab)
    got = {table[i] for i in allowed(word)}
    assert got and all(b" P".startswith(b) or re.fullmatch(rb" P(a|ar|ari|aris|aris!|ar!)", b) for b in got)
    assert {b" ", b" P", b" Paris", b" Par"} <= got and b" PL" not in got


def test_accept_rollback_copy_and_settling(tokenizer, xgr):
    vocab = healing_vocab(tokenizer)
    tid = lambda text: tokenizer.convert_tokens_to_ids(text)  # noqa: E731
    g = HealingGrammar(xgr.compile("regex", "[0-9]+ days"), b" ", vocab)
    assert not g.accept(tid("7")) and not g.accept(tokenizer.eos_token_id)  # must spell the space first
    twin = g.copy()
    assert g.accept(tid("Ġ")) and g.settled and g.inner.accept(tid("7"))
    assert not twin.settled and twin.accept(tid("Ġ"))
    g.rollback(1)  # the inner step is the grammar's own; the healing step undoes the space
    assert not g.settled


def test_stop_crossing_gives_a_short_integer(tokenizer, xgr):
    vocab = healing_vocab(tokenizer)
    stops = [" ", "\n"]
    g = HealingGrammar(xgr.compile("regex", r"[-+]?[0-9]+[ \n]*"), b"", vocab, stops, xgr.stop_token_ids)
    assert g.accept(tokenizer.convert_tokens_to_ids("2")) and g.accept(tokenizer.convert_tokens_to_ids("4"))
    hours = tokenizer.convert_tokens_to_ids("Ġhours")
    assert hours in allowed(g)  # "24" + " hours": the stop " " ends the integer, the rest is cut
    assert g.accept(hours) and g.jump_forward() is None and not g.accept(tokenizer.convert_tokens_to_ids("2"))
    g2 = HealingGrammar(xgr.compile("regex", r"[0-9]+x"), b"", vocab, stops, xgr.stop_token_ids)
    assert g2.accept(tokenizer.convert_tokens_to_ids("2")) and hours not in allowed(g2)  # "2" cannot end


def test_output_text_leaves_the_healed_text_out(tokenizer):
    params = SimpleNamespace(token_healing=True, max_new_tokens=8, stop=[" "], constraint=None, ignore_eos=False,
                             stop_token_ids=[], min_new_tokens=0, stop_regex=[])
    prompt = tokenizer.encode("The capital of France is ")
    healing = plan_healing(prompt, params, tokenizer)
    assert healing.text == " " and healing.removed == prompt[-1]
    req = SimpleNamespace(input_ids=list(prompt), params=params, healing=None, grammar=None, parked=None)
    start_healing(req, tokenizer)
    assert req.input_ids == prompt[:-1] and isinstance(req.grammar, HealingGrammar)
    out = tokenizer.encode(" Paris is big")
    detok = IncrementalDetokenizer(tokenizer, [], strip_prefix=" ")
    pieces = [detok.add([t], None) for t in out]
    assert "".join(pieces) + detok.add([], FinishReason("length")) == "Paris is big"
    detok = IncrementalDetokenizer(tokenizer, [], strip_prefix="  ")  # healed text longer than a token
    assert detok.add(tokenizer.encode(" "), None) == "" and detok.add(tokenizer.encode(" x"), None) == "x"
    req.output_ids, req.seq_len = out[:1], len(prompt) + 2  # " Paris": that " " is the prompt's
    runner = SimpleNamespace(tokenizer=tokenizer, context_len=2048)
    assert check_finish(req, frozenset({2}), runner) is None
    req.output_ids = out[:2]
    assert check_finish(req, frozenset({2}), runner) == FinishReason("stop", matched=" ")


def test_engine_heals_with_and_without_constraints(engine):
    greedy = {"temperature": 0, "max_new_tokens": 6}
    plain = engine.generate("The capital of France is ", greedy)
    default = engine.generate("The capital of France is ", {**greedy, "token_healing": False})
    healed = engine.generate("The capital of France is ", {**greedy, "token_healing": True})
    assert default["text"] == plain["text"]  # off by default: the output is unchanged
    assert healed["text"].startswith("Paris") and not plain["text"].startswith("Paris")
    assert healed["meta_info"]["prompt_tokens"] == plain["meta_info"]["prompt_tokens"] - 1
    stops = {"regex": r"[-+]?[0-9]+[ \n]*", "stop": [" ", "\n"], "temperature": 0, "max_new_tokens": 16}
    short = engine.generate("A week has ", {**stops, "token_healing": True})
    assert re.fullmatch(r"[0-9]{1,3}", short["text"]) and short["meta_info"]["finish_reason"]["type"] == "stop"
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    doc = engine.generate('Reply in JSON: ', {"json_schema": json.dumps(schema), "temperature": 0,
                                              "max_new_tokens": 24, "token_healing": True})
    jsonschema.validate(json.loads(doc["text"]), schema)
    chunks = list(engine.generate("The capital of France is ", {**greedy, "token_healing": True}, stream=True))
    assert chunks[-1]["text"] == healed["text"] and all(c["text"].startswith(chunks[0]["text"]) for c in chunks)


def test_token_healing_example(engine, monkeypatch):
    import importlib.util
    from pathlib import Path

    monkeypatch.setenv("RADIXLM_EXAMPLE_MAX_TOKENS", "8")
    path = Path(__file__).resolve().parent.parent / "examples" / "token_healing.py"
    spec = importlib.util.spec_from_file_location("radixlm_example_token_healing", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    capital, colour, week = example.main(backend=engine)
    assert capital["healed"].startswith("Paris") and colour["healed"].startswith("ue")
    assert week["healed"].isdigit() and len(week["healed"]) <= 3 and len(week["plain"]) > len(week["healed"])
