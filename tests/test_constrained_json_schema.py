"""radixlm.constrained's JSON schemas on the built-in SmolLM2 tokenizer: a sample of the JSON-schema corpus,
combined keywords, dead ends, unusable schemas, and relaxing and closing a schema (hypothesis)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import test_constrained
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples
from test_constrained import NAMES, allowed_ids, json_can_end, walk

from radixlm.constrained import GrammarError

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschema"

# test_constrained.py's module-scoped fixtures, shared by name (imported as such, ruff reads them as unused)
backends, tb, tok = test_constrained.backends, test_constrained.tb, test_constrained.tok


# outlines-core needs ~7 s for Github_trivial's 4th schema on 2 shared cores: it gets Github_easy
SAMPLE = {
    "xgrammar": ("Github_trivial.jsonl", "Glaiveai2K.jsonl", "BFCL_simple.jsonl", "Synthesized.jsonl"),
    "outlines": ("Github_easy.jsonl", "Glaiveai2K.jsonl", "BFCL_simple.jsonl"),
    "llguidance": ("Github_trivial.jsonl", "Glaiveai2K.jsonl", "Snowplow.jsonl", "Synthesized.jsonl",
                   "Handwritten.jsonl"),
}


def _corpus_sample(files, per_file=5):
    for f in files:
        with open(CORPUS / f) as fh:
            for _ in range(per_file):
                yield json.loads(fh.readline())


# (schema id, test index) -> why the backend rejects a valid instance; such cases must stay within
# this list. Accepting an invalid instance is never allowed (the end check rejects it).
KNOWN_GAPS = {
    "xgrammar": {
        ("Synthesized---draft2019_09_nonvalid_additionalProperties_id10_subschema1_not_2", 0):
            "allOf with several branches: xgrammar compiles it to a grammar that misses the enum's object",
    },
    "outlines": {},
    "llguidance": {},
}


@pytest.mark.skipif(not CORPUS.is_dir(), reason=f"JSON-schema corpus not found at {CORPUS}")
@pytest.mark.parametrize("name", NAMES)
def test_corpus_sample_never_accepts_an_invalid_document(backends, tok, name):
    from radixlm.constrained.json_schema import validator_class

    backend, checked, rejected_valid = backends[name], 0, set()
    for entry in _corpus_sample(SAMPLE[name]):
        spec = json.dumps(entry["schema"])
        try:
            backend.compile("json_schema", spec)
        except GrammarError:
            continue
        validator = validator_class(entry["schema"])(entry["schema"])
        for i, case in enumerate(entry["tests"]):
            g = backend.compile("json_schema", spec)
            text = json.dumps(case["data"], separators=(",", ":"), ensure_ascii=False)
            accepted = all(g.accept(t) for t in tok.encode(text)) and g.accept(tok.eos_token_id)
            checked += 1
            valid = validator.is_valid(case["data"])  # formats are not asserted (jsonschema's default)
            assert not accepted or valid, f"{name} accepted an invalid document: {entry['id']} #{i} {text[:200]}"
            if valid and case["valid"] and not accepted:
                rejected_valid.add((entry["id"], i))
    assert checked >= 30
    unexpected = rejected_valid - KNOWN_GAPS[name].keys()
    assert not unexpected, f"{name} rejected these valid corpus cases: {sorted(unexpected)}"


# allOf + oneOf (with overlapping branches: "a" matches both, so it is invalid) + patternProperties +
# $ref: every backend must produce only documents that validate, whatever it can express itself
COMBO = {
    "$defs": {"pos": {"type": "integer", "minimum": 1, "maximum": 99}},
    "type": "object",
    "properties": {"id": {"$ref": "#/$defs/pos"},
                   "kind": {"oneOf": [{"const": "a"}, {"type": "string", "maxLength": 1, "pattern": "^[a-c]$"}]}},
    "patternProperties": {"^x_": {"type": "boolean"}},
    "additionalProperties": False,
    "allOf": [{"required": ["id"]}, {"required": ["kind"]}, {"not": {"properties": {"id": {"const": 7}}}}],
}


@pytest.mark.parametrize("name", NAMES)
def test_allof_oneof_patternproperties_ref_never_violated(backends, tok, tb, name):
    backend, spec = backends[name], json.dumps(COMBO)
    try:
        backend.compile("json_schema", spec)
    except GrammarError as e:  # refused: the message names what it cannot do
        assert re.search(r"allOf|oneOf|patternProperties|\$ref|not", str(e)), e
        return
    can_end = json_can_end(COMBO)
    for seed in range(6):
        text = walk(backend, backend.compile("json_schema", spec), tb, can_end, seed, max_tokens=60)
        assert text is None or can_end(text)
    cases = [({"id": 3, "kind": "a"}, False), ({"id": 7, "kind": "b"}, False), ({"id": 3, "kind": "b"}, True)]
    for doc, valid in cases:
        g = backend.compile("json_schema", spec)
        tokens = tok.encode(json.dumps(doc, separators=(",", ":")))
        if all(g.accept(t) for t in tokens):  # the backend may order or format keys its own way
            assert g.accept(tok.eos_token_id) == valid, doc


def test_dead_end_refuses_to_end_and_says_why(backends, tok):
    spec = json.dumps({"enum": [1, 2], "not": {"const": 2}})
    g = backends["llguidance"].compile("json_schema", spec)
    assert g.relaxed_keywords == {"not"}
    assert g.accept(tok.convert_tokens_to_ids("2"))
    assert allowed_ids(backends["llguidance"], g) == [tok.eos_token_id]  # never an empty mask
    assert not g.accept(tok.eos_token_id) and "should not be valid" in g.error_message
    g.rollback(1)
    assert g.accept(tok.convert_tokens_to_ids("1")) and g.accept(tok.eos_token_id) and g.is_terminated()


@pytest.mark.parametrize("spec,fragment", [
    ('{"type": "objekt"}', "objekt"),
    (json.dumps({"type": "string", "pattern": r"\p{L}+"}), "pattern"),  # Python's re cannot check it
])
def test_unusable_schemas_are_rejected_naming_the_problem(backends, spec, fragment):
    for backend in backends.values():
        with pytest.raises(GrammarError, match=fragment):
            backend.compile("json_schema", spec)


RELAX_SCHEMAS = [
    {"type": "integer", "not": {"enum": [1, 2]}, "multipleOf": 3, "minimum": -50},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "contains": {"const": 0}, "maxItems": 4},
    {"type": "object", "dependencies": {"a": ["b"]}, "propertyNames": {"maxLength": 1},
     "properties": {"a": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}}},
]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-60, 60) | st.text("ab", max_size=3),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text("abc", max_size=2), inner, max_size=3),
    max_leaves=8,
)


@given(value=JSON_VALUES, index=st.integers(0, len(RELAX_SCHEMAS) - 1), level=st.integers(0, 2))
@settings(max_examples=examples(300), deadline=None)
def test_relaxing_a_schema_never_rejects_a_valid_document(value, index, level):
    from radixlm.constrained.json_schema import relax, validator_class
    from radixlm.constrained.llguidance_backend import RELAX_LEVELS

    schema = RELAX_SCHEMAS[index]
    keep, formats = RELAX_LEVELS[level]
    relaxed = relax(schema, keep, formats)
    if validator_class(schema)(schema).is_valid(value):
        assert validator_class(relaxed.schema)(relaxed.schema).is_valid(value), (value, relaxed)
    assert relaxed.dropped <= {"not", "uniqueItems", "contains", "dependencies", "propertyNames", "oneOf",
                               "multipleOf", "minimum", "maxItems"}


CLOSE_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"},
                                      "b": {"anyOf": [{"type": "object", "properties": {"c": {}}}, {"type": "null"}]}}},
    {"$defs": {"n": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
    {"type": "object", "properties": {"a": {}}, "patternProperties": {"^b": {"type": "integer"}}},
]


@given(value=JSON_VALUES, index=st.integers(0, len(CLOSE_SCHEMAS) - 1))
@settings(max_examples=examples(300), deadline=None)
def test_closing_objects_only_refuses_unlisted_keys(value, index):
    """Closed objects accept a subset of what the schema accepts, and refuse a valid document
    only for a key its object does not list."""
    from radixlm.constrained.json_schema import close_objects, validator_class

    schema = CLOSE_SCHEMAS[index]
    closed = close_objects(schema)
    closed_ok = validator_class(closed)(closed).is_valid(value)
    if closed_ok:
        assert validator_class(schema)(schema).is_valid(value)
    elif validator_class(schema)(schema).is_valid(value):
        def leaves(error):  # an anyOf error holds its branches' errors in .context
            return [leaf for sub in error.context for leaf in leaves(sub)] if error.context else [error]

        errors = list(validator_class(closed)(closed).iter_errors(value))
        assert errors and all(any(leaf.validator == "additionalProperties" for leaf in leaves(e)) for e in errors)


def test_objects_stay_open_where_closing_would_refuse_valid_documents():
    from radixlm.constrained.json_schema import close_objects

    merged = [{"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
              {"properties": {"a": {}}, "required": ["b"]},
              {"$defs": {"base": {"properties": {"a": {}}}}, "$ref": "#/$defs/base", "properties": {"b": {}}},
              {"properties": {"a": {}}, "if": {"required": ["a"]}, "then": {"properties": {"b": {}}}}]
    for schema in merged:
        assert close_objects(schema) is schema
    assert close_objects({"properties": {"a": {}}, "required": ["a"]})["additionalProperties"] is False


REBASE_SCHEMAS = [
    # pydantic's shape: $defs with nested and optional submodels
    {"$defs": {"C": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
     "type": "object", "properties": {"b": {"$ref": "#/$defs/C"}, "c": {"anyOf": [{"$ref": "#/$defs/C"},
                                                                                  {"type": "null"}]}}},
    # a recursive model at the root, draft-07's definitions, a pointer that is not into $defs
    {"$defs": {"N": {"type": "object", "properties": {"b": {"type": "array", "items": {"$ref": "#/$defs/N"},
                                                            "maxItems": 2}}}}, "$ref": "#/$defs/N"},
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"s": {"type": "string"}},
     "type": "object", "properties": {"a": {"$ref": "#/definitions/s"}, "b": {"$ref": "#/properties/a"}}},
    # the schema itself, and an instance value that looks like a reference but is data
    {"type": "object", "properties": {"a": {"$ref": "#"}, "b": {"const": {"$ref": "#/x"}}}},
    {"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveAnchor": True,
     "type": "object", "properties": {"a": {"$recursiveRef": "#"}, "b": {"type": "integer"}}},
]


@given(value=JSON_VALUES | st.fixed_dictionaries({}, optional={"a": JSON_VALUES, "b": JSON_VALUES}),
       index=st.integers(0, len(REBASE_SCHEMAS) - 1))
@settings(max_examples=examples(300), deadline=None)
def test_a_rebased_schema_judges_as_the_original_where_it_is_embedded(value, index):
    """A tool's schema moved under another document's $defs (tool_choice "required" combines tools
    so) accepts exactly what it accepted alone."""
    from radixlm.constrained.json_schema import make_validator, rebase_refs

    schema = REBASE_SCHEMAS[index]
    embedded = {"$defs": {"tool_1": rebase_refs(schema, "/$defs/tool_1")},
                "type": "array", "items": {"$ref": "#/$defs/tool_1"}}
    assert make_validator(schema).is_valid(value) == make_validator(embedded).is_valid([value]), value
    if index == 3:  # data is not a schema: a const that holds a "$ref" key keeps it
        assert rebase_refs(schema, "/$defs/tool_1")["properties"]["b"]["const"] == {"$ref": "#/x"}


@pytest.mark.parametrize("keyword, value", [("maxLength", 2**70), ("maxItems", 2**40), ("maxProperties", 1e30)])
def test_unreachable_bounds_compile_and_still_bound_nothing(backends, tok, keyword, value):
    """An upper bound no output can reach is left out of the grammar (backends refuse such numbers);
    the documents allowed stay the same, so the end check still agrees with every output."""
    from radixlm.constrained.json_schema import without_unreachable_bounds

    schema = {"type": "object", "properties": {"a": {"type": "string", keyword: value}}, "required": ["a"]}
    assert without_unreachable_bounds(schema)["properties"]["a"] == {"type": "string"}
    near = {"type": "string", "maxLength": 2**30 - 1}
    assert without_unreachable_bounds(near) == near
    for backend in backends.values():
        grammar = backend.compile_async("json_schema", json.dumps(schema)).result(timeout=60)
        assert not grammar.is_terminated()
