"""radixlm.constrained on the built-in SmolLM2 tokenizer: random valid walks, masks, rollback,
copy, jump-forward, bad specs and the bitmask helpers. The compile cache and thread pool are tested in
test_constrained_compile_cache.py, JSON schemas (a corpus sample, relaxing, closing) in
test_constrained_json_schema.py; both use this module's fixtures and helpers."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.constrained import (
    ANY_JSON_OBJECT,
    GrammarError,
    allocate_bitmask,
    apply_bitmask,
    bitmask_to_bool,
    create_grammar_backend,
)
from radixlm.constrained.vocab import special_token_ids, token_bytes

V = 49152  # SmolLM2's vocab
NAMES = ["xgrammar", "outlines", "llguidance"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer"},
        "tier": {"enum": ["gold", "silver", 3, None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "loc": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
    },
    "required": ["name", "age", "tier", "tags", "ok", "loc"],
}
CUSTOMER = {
    "type": "object",
    "properties": {"customer_full_name": {"type": "string"}},
    "required": ["customer_full_name"],
}
REGEXES = [r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})? (USD|EUR)", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)( ok)?"]
EXPR_EBNF = 'root ::= expr\nexpr ::= [0-9] | "(" expr op expr ")"\nop ::= "+" | "*"'
ANSWER_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {
            "x": {"type": "integer"}}, "required": ["x"]}},
        "end": "</answer>",
    },
}
LEGACY_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<function=get_weather>", "end": "</function>", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
    "triggers": ["<function="],
}


@pytest.fixture(scope="module")
def tok(tokenizer):  # conftest's session-wide SmolLM2 tokenizer
    return tokenizer


@pytest.fixture(scope="module")
def backends(tok):
    made = {name: create_grammar_backend(name, tok, V) for name in NAMES}
    yield made
    for backend in made.values():
        backend.shutdown()


@pytest.fixture(scope="module")
def tb(tok):
    return token_bytes(tok, V)


def _filled(backend, grammar) -> torch.Tensor:
    bm = backend.allocate_bitmask(1)
    grammar.fill_mask(bm, 0)
    return bm


def allowed_ids(backend, grammar) -> list[int]:
    return bitmask_to_bool(_filled(backend, grammar), backend.vocab_size)[0].nonzero().flatten().tolist()


def walk(backend, grammar, tb, can_end, seed: int, max_tokens: int = 200) -> str | None:
    """Random valid walk; checks at every step that EOS is allowed exactly when ``can_end(text)``.
    Returns the text if the walk terminated."""
    rng, eos, data = random.Random(seed), backend.stop_token_ids[0], b""
    for _ in range(max_tokens):
        allowed = allowed_ids(backend, grammar)
        assert allowed, f"no token allowed after {data!r}"
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = None
        if getattr(grammar, "error_message", None):  # a dead end: the end check refuses to stop here
            assert allowed == [eos] and not can_end(text) and not grammar.accept(eos), data
            return None
        assert (eos in allowed) == (text is not None and can_end(text)), f"EOS bit wrong after {data!r}"
        forced = grammar.jump_forward()
        if forced:  # every allowed token must agree with the forced continuation
            fb = forced.encode()
            assert all(fb.startswith(tb[t]) or tb[t].startswith(fb) for t in allowed), (data, forced)
        others = [t for t in allowed if t != eos]
        token = eos if eos in allowed and (not others or rng.random() < 0.3) else rng.choice(others)
        assert grammar.accept(token)
        if token == eos:
            assert grammar.is_terminated() and not grammar.accept(eos)
            return text
        assert not grammar.is_terminated()
        data += tb[token]
    return None


def json_can_end(schema):
    validator = jsonschema.Draft202012Validator(schema)

    def can_end(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return validator.is_valid(value)

    return can_end


def parse_expr(text: str) -> bool:
    def expr(i: int) -> int:  # index after one expr, or -1
        if i < len(text) and text[i].isdigit():
            return i + 1
        if i < len(text) and text[i] == "(":
            i = expr(i + 1)
            if i < 0 or i >= len(text) or text[i] not in "+*":
                return -1
            i = expr(i + 1)
            return i + 1 if 0 <= i < len(text) and text[i] == ")" else -1
        return -1

    return expr(0) == len(text)


def answer_can_end(text: str) -> bool:
    m = re.fullmatch(r"<answer>(.*)</answer>", text, re.S)
    return m is not None and json_can_end(ANSWER_TAG["format"]["content"]["json_schema"])(m.group(1))


CASES = [(n, "regex", rx, lambda t, rx=rx: re.fullmatch(rx, t) is not None) for n in NAMES for rx in REGEXES]
CASES += [(n, "json_schema", json.dumps(PERSON), json_can_end(PERSON)) for n in NAMES]
CASES += [(n, "ebnf", EXPR_EBNF, parse_expr) for n in ("xgrammar", "llguidance")]
CASES += [("xgrammar", "structural_tag", json.dumps(ANSWER_TAG), answer_can_end)]


@pytest.mark.parametrize("name,kind,spec,can_end", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_random_valid_walks(backends, tb, tok, name, kind, spec, can_end):
    backend, finished = backends[name], 0
    for seed in range(4):
        text = walk(backend, backend.compile(kind, spec), tb, can_end, seed)
        if text is not None:
            finished += 1
            assert can_end(text), text
    assert finished >= 2, "most walks should terminate within 200 tokens"


def test_vocab_bytes_match_xgrammar(tok, tb):
    import xgrammar as xgr

    ref = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V).decoded_vocab
    special = special_token_ids(tok)
    assert {0, 1, 2} <= special
    assert all(tb[i] is None if i in special else tb[i] == ref[i] for i in range(V))
    assert tb[tok.convert_tokens_to_ids("Ġloc")] == b" loc"


@pytest.mark.parametrize("name", NAMES)
def test_control_tokens_and_padding_never_allowed(tok, name):
    backend = create_grammar_backend(name, tok, V + 40)  # model vocab wider than the tokenizer's
    g = backend.compile("regex", r"[^\n]{0,5}")
    ids = set(allowed_ids(backend, g))
    assert tok.eos_token_id in ids and 0 not in ids and 1 not in ids and not ids & set(range(V, V + 40))
    assert not g.accept(1) and not g.accept(V + 3) and g.accept(tok.convert_tokens_to_ids("a"))
    backend.shutdown()


@pytest.mark.parametrize("name", NAMES)
def test_rollback_and_reaccept_give_same_masks(backends, tok, name):
    backend = backends[name]
    g = backend.compile("json_schema", json.dumps(PERSON))
    doc = {"name": "Ann", "age": 41, "tier": "gold", "tags": ["a"], "ok": True, "loc": {"x": 1.5}}
    tokens = tok.encode(json.dumps(doc, separators=(",", ":")))
    masks = [_filled(backend, g)]
    for t in tokens:
        assert g.accept(t)
        masks.append(_filled(backend, g))
    g.rollback(4)
    assert torch.equal(_filled(backend, g), masks[-5])
    assert all(g.accept(t) for t in tokens[-4:])
    assert torch.equal(_filled(backend, g), masks[-1])
    assert g.accept(tok.eos_token_id) and g.is_terminated()
    assert allowed_ids(backend, g) == [tok.eos_token_id]
    g.rollback(1)  # undo the EOS
    assert not g.is_terminated() and torch.equal(_filled(backend, g), masks[-1])
    with pytest.raises(ValueError):
        g.rollback(10_000)


@pytest.mark.parametrize("name", NAMES)
def test_copy_is_independent(backends, tok, name):
    backend = backends[name]
    g = backend.compile("regex", REGEXES[1])
    assert g.accept(tok.convert_tokens_to_ids("ab"))
    before = _filled(backend, g)
    c = g.copy()
    assert all(c.accept(t) for t in tok.encode("@xy.com")) and c.accept(tok.eos_token_id)
    assert c.is_terminated() and not g.is_terminated() and torch.equal(_filled(backend, g), before)
    assert g.accept(tok.convert_tokens_to_ids("c"))  # moving g leaves the copy terminated
    assert c.is_terminated()


@pytest.mark.parametrize("name", NAMES)
def test_jump_forward_fixed_key(backends, tok, name):
    g = backends[name].compile("json_schema", json.dumps(CUSTOMER))
    forced = g.jump_forward()
    assert forced == '{"customer_full_name":"'  # compact JSON: the key and its quote are forced
    assert g.accept_string(forced) and g.jump_forward() is None  # free string content
    assert not g.accept_string('"}x')
    assert all(g.accept(t) for t in tok.encode('Ada L"}')) and g.jump_forward() is None
    assert g.accept(tok.eos_token_id) and g.is_terminated()
    g2 = backends[name].compile("json_schema", json.dumps(CUSTOMER))
    assert g2.accept_string("{")
    g2.rollback(1)  # a string is one step
    assert g2.jump_forward() == forced


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_structural_tag_legacy_format(backends, tok, name):
    backend = backends[name]
    g = backend.compile("structural_tag", json.dumps(LEGACY_TAG))
    eos = tok.eos_token_id
    assert g.accept_string("Let me check. ") and eos in allowed_ids(backend, g)  # free text may end
    assert g.accept_string("<function=get_weather>") and eos not in allowed_ids(backend, g)
    assert not g.copy().accept_string('{"town"')
    assert g.accept_string('{"city": "Paris"}') and g.jump_forward() == "</function>"
    assert g.accept_string("</function>") and g.accept(eos) and g.is_terminated()


@pytest.mark.parametrize("name", NAMES)
def test_any_json_object(backends, tok, tb, name):
    backend = backends[name]
    g = backend.compile("json_schema", ANY_JSON_OBJECT)
    assert all(g.accept(t) for t in tok.encode('{"a":[1,{"b":null}],"c":"x"}')) and g.accept(tok.eos_token_id)
    assert not backend.compile("json_schema", ANY_JSON_OBJECT).accept_string("[1]")
    is_object = json_can_end({"type": "object"})
    for seed in range(2):  # may not finish (unbounded), but EOS must be right at every step
        text = walk(backend, backend.compile("json_schema", ANY_JSON_OBJECT), tb, is_object, seed, 60)
        assert text is None or is_object(text)



@pytest.mark.parametrize("name,regex_unicode,pattern_unicode",
                         [("llguidance", True, False), ("xgrammar", False, False), ("outlines", True, True)])
def test_digit_class_reads_as_documented(backends, name, regex_unicode, pattern_unicode):
    """README: `\\d` in a `regex` is any Unicode decimal digit (as in Python's `re`) on llguidance and
    outlines, ASCII on xgrammar; in a schema's `pattern` it is ASCII (ECMA-262) but on outlines."""
    backend = backends[name]
    schema = json.dumps({"type": "string", "pattern": r"^\d{3}$"})
    for digits, ascii_only in (("123", True), ("\u0661\u0662\u0663", False), ("\uff11\uff12\uff13", False)):
        assert backend.compile("regex", r"\d{3}").accept_string(digits) == (ascii_only or regex_unicode)
        document = json.dumps(digits, ensure_ascii=False)
        assert backend.compile("json_schema", schema).accept_string(document) == (ascii_only or pattern_unicode)

BAD = [
    ("xgrammar", "regex", "[a-z", "Unclosed"),
    ("xgrammar", "json_schema", "{not json", "not valid JSON"),
    ("xgrammar", "json_schema", '{"type":"integer","minimum":5,"maximum":1}', "minimum greater than maximum"),
    ("xgrammar", "json_schema", '{"$ref":"#/$defs/nope"}', "$defs"),
    ("xgrammar", "json_schema", '{"type":"foo"}', "foo"),
    ("xgrammar", "ebnf", 'root ::= "a" | bogus', "bogus"),
    ("xgrammar", "ebnf", 'start ::= "a"', "root"),
    ("xgrammar", "structural_tag", '{"structures":[{"begin":"<a>"}],"triggers":["<a"]}', "'schema'"),
    ("xgrammar", "structural_tag", '{"type":"structural_tag"}', "format"),
    ("xgrammar", "choices", "a", "supported: ebnf, json_schema, regex, structural_tag"),
    ("outlines", "regex", "[a-z", "unterminated character set"),
    ("outlines", "regex", "a(?=b)", "lookaround"),
    ("outlines", "json_schema", "{not json", "not valid JSON"),
    ("outlines", "json_schema", '{"$ref":"#/$defs/nope"}', "$defs"),
    ("outlines", "ebnf", 'root ::= "a"', "'outlines' does not support 'ebnf'"),
]


@pytest.mark.parametrize("name,kind,spec,fragment", BAD)
def test_bad_specs_raise_grammar_error(backends, name, kind, spec, fragment):
    for _ in range(2):  # the failure is cached, and raised again
        with pytest.raises(GrammarError) as info:
            backends[name].compile(kind, spec)
        assert fragment in str(info.value) and str(info.value).startswith(("invalid", "grammar backend"))


def test_unknown_backend_names_the_choices(tok):
    with pytest.raises(ValueError, match="xgrammar, outlines, llguidance"):
        create_grammar_backend("guidance", tok, V)
@settings(max_examples=examples(60), deadline=None)
@given(rows=st.integers(1, 4), words=st.integers(1, 6), extra=st.integers(-31, 40), seed=st.integers(0, 2**16))
def test_bitmask_unpack_matches_numpys_bit_by_bit_unpack(rows, words, extra, seed):
    """The byte-table unpack (constrained/bitmask.py) against numpy's little-endian unpack, for vocab sizes
    that cut the last word or run past the mask (those tokens are disallowed)."""
    gen = torch.Generator().manual_seed(seed)
    bm = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=gen)
    vocab = max(1, words * 32 + extra)
    bits = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little").astype(bool)
    ref = np.zeros((rows, vocab), dtype=bool)
    ref[:, : min(vocab, words * 32)] = bits[:, :vocab]
    assert torch.equal(bitmask_to_bool(bm, vocab), torch.from_numpy(ref))


def test_bitmask_helpers_cpu_and_cuda():
    torch.manual_seed(0)
    bm = torch.randint(-(2**31), 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32)
    ref = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    assert torch.equal(bitmask_to_bool(bm, V), torch.from_numpy(ref))
    assert allocate_bitmask(2, V).shape == (2, 1536)
    assert bool(bitmask_to_bool(allocate_bitmask(1, V), V).all())
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        logits = torch.randn(3, V + 7, device=device)  # wider than the mask: the extra ids are masked
        want = logits.clone()
        want[:, :V][~torch.from_numpy(ref).to(device)] = float("-inf")
        want[:, V:] = float("-inf")
        got = logits.clone()
        apply_bitmask(got, bm.to(device))
        assert torch.equal(got, want)
        got = logits.clone()
        apply_bitmask(got, bm, rows=torch.tensor([0, 2]))  # bitmask on CPU, logits maybe on GPU
        assert torch.equal(got[[0, 2]], want[[0, 2]]) and torch.equal(got[1], logits[1])


@settings(max_examples=examples(60), deadline=None)
@given(words=st.integers(1, 5), ids=st.lists(st.integers(0, 200), max_size=5), value=st.booleans(),
       seed=st.integers(0, 2**16))
def test_single_bits_set_cleared_and_read_as_the_unpack_sees_them(words, ids, value, seed):
    """set_bits / set_only / bit_is_set (word by word through a numpy view on the CPU) against the
    unpacked mask: only the named ids change (ids past the mask are skipped), sign bits included;
    set_bits_of_rows as set_bits row by row."""
    from radixlm.constrained.bitmask import bit_is_set, set_bits, set_bits_of_rows, set_only

    gen = torch.Generator().manual_seed(seed)
    bm = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32, generator=gen)
    before = bitmask_to_bool(bm, words * 32)
    set_bits(bm, 1, ids, value)
    want = before.clone()
    inside = [t for t in ids if t < words * 32]
    want[1, inside] = value
    assert torch.equal(bitmask_to_bool(bm, words * 32), want)
    assert bit_is_set(bm, 1, ids) == (value and bool(inside))
    assert bit_is_set(bm, 0, ids) == bool(before[0, inside].any())
    set_only(bm, 0, ids)
    only = torch.zeros(words * 32, dtype=torch.bool)
    only[inside] = True
    assert torch.equal(bitmask_to_bool(bm, words * 32)[0], only)
    many, one = bm.clone(), bm.clone()  # the batch form: several rows, each set or cleared
    set_bits_of_rows(many, [1, 0], ids, [value, not value])
    set_bits(one, 1, ids, value)
    set_bits(one, 0, ids, not value)
    assert torch.equal(many, one)


@given(steps=st.lists(st.integers(0, 40), min_size=2, max_size=6), seed=st.integers(0, 2**16))
@settings(max_examples=examples(25), deadline=None)
def test_masks_filled_at_once_equal_masks_filled_one_by_one(backends, tok, steps, seed):
    """llguidance's batch fill (its executor: every core, the GIL released) gives each row the mask its
    own fill_mask gives, for grammars at random states (end-checked JSON, regex, terminated ones)."""
    backend = backends["llguidance"]
    specs = [("json_schema", json.dumps(PERSON)), ("regex", REGEXES[0]), ("json_schema", json.dumps(CUSTOMER))]
    rng = random.Random(seed)
    grammars = []
    for i, n in enumerate(steps):
        g = backend.compile(*specs[i % len(specs)])
        for _ in range(n):  # a random walk of n tokens (or until it ends)
            allowed = allowed_ids(backend, g)
            if g.is_terminated() or not allowed:
                break
            assert g.accept(rng.choice(allowed))
        grammars.append(g)
    serial = backend.allocate_bitmask(len(grammars))
    for row, g in enumerate(grammars):
        g.fill_mask(serial, row)
    at_once = backend.allocate_bitmask(len(grammars))
    targets = [(t, row) for row, g in enumerate(grammars) if (t := g.batch_target()) is not None]
    backend.fill_rows(targets, at_once)
    for row, g in enumerate(grammars):
        g.fill_mask(at_once, row)
    assert torch.equal(at_once, serial)
    rows = [row for _, row in targets]
    if len(targets) > 1:  # the rows really were computed at once, not again one by one
        stale = backend.allocate_bitmask(len(grammars))
        backend.fill_rows(targets, stale)
        row = max(rows, key=lambda r: int(bitmask_to_bool(serial[r : r + 1], V).sum()))
        stale[row].zero_()  # a fill_mask that recomputed its row would undo this
        grammars[row].fill_mask(stale, row)
        assert bitmask_to_bool(stale[row : row + 1], V).sum() <= len(backend.stop_token_ids)


@settings(max_examples=examples(60), deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list('{}[]":, \n\tab1.eé😀\\_-')), max_size=40))
def test_jump_forward_codec_answers_as_the_tokenizer(tok, text):
    """Jump-forward re-tokenizes through the fast tokenizer's backend when it answers as the wrapper
    does (the built-in tokenizer's does): same ids for any text, same text back."""
    from radixlm.runtime.scheduler.grammars import GrammarManager

    encode, decode = GrammarManager("llguidance", tok, V, [tok.eos_token_id], True).codec
    assert getattr(encode, "__code__", None) is not None and "backend" in encode.__code__.co_freevars
    ids = tok.encode(text, add_special_tokens=False)
    assert encode(text) == ids and decode(ids) == tok.decode(ids)
