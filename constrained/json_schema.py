"""JSON-schema tooling shared by the grammar backends: the reference validator, the keyword walk,
and relaxation (dropping the keywords a backend's compiler rejects).

The rule every backend follows: a ``json_schema`` is enforced in full or rejected when it is
compiled, never silently ignored. Backends differ in which keywords their grammars can express,
so enforcement has two layers:

1. the backend's grammar, compiled from the schema (or from a relaxed copy of it: the same schema
   with the keywords the backend cannot express removed, which only ever allows *more*
   documents), and
2. the end check (``end_check.py``): a document may end only if ``jsonschema`` validates it
   against the original schema, with the schema's own draft (``$schema``; 2020-12 by default).

So no complete document that violates the schema can come out, whatever the backend ignores or
gets wrong. ``format`` is an annotation in JSON Schema (``jsonschema`` does not assert it by
default): backends enforce the formats they know and the end check does not add any.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import referencing
import referencing.exceptions

from radixlm.constrained.base import GrammarError

# Keywords whose value is one subschema / a list of subschemas / a map of name -> subschema.
SCHEMA_KEYWORDS = frozenset({
    "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
    "unevaluatedItems", "unevaluatedProperties", "contentSchema",
})
SCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
SCHEMA_MAP_KEYWORDS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})

# Every keyword that constrains an instance, over drafts 4 to 2020-12 (annotations such as title,
# description, default, examples, readOnly, $comment and unknown extension keys constrain nothing).
ASSERTION_KEYWORDS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "maxProperties", "minProperties", "required", "dependentRequired", "dependencies", "items",
    "$ref", "$dynamicRef", "$recursiveRef",
}) | SCHEMA_KEYWORDS | SCHEMA_LIST_KEYWORDS | (SCHEMA_MAP_KEYWORDS - {"$defs", "definitions"})


def parse_schema(spec: str) -> Any:
    """The schema of a ``json_schema`` spec, checked against its draft's meta-schema."""
    try:
        schema = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"invalid json_schema: not valid JSON: {e}") from e
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("invalid json_schema: a schema must be a JSON object or a boolean")
    try:
        validator_class(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise GrammarError(f"invalid json_schema: {e.message} (at {where})") from e
    return schema


def validator_class(schema: Any) -> type:
    """The validator of the schema's own draft (``$schema``), Draft 2020-12 when it names none."""
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def _retrieve_nothing(uri: str) -> referencing.Resource:
    # jsonschema's default registry fetches unknown URIs (http://, file://) when a $ref or
    # $dynamicRef names one: a request must never make the server open a socket or a file
    raise referencing.exceptions.NoSuchResource(ref=uri)


NO_RETRIEVAL = referencing.Registry(retrieve=_retrieve_nothing)


def make_validator(schema: Any) -> Any:
    """A validator of ``schema`` whose references resolve only inside the document."""
    return validator_class(schema)(schema, registry=NO_RETRIEVAL)


def subschemas(schema: Any) -> Iterator[tuple[str, Any]]:
    """(keyword, child schema) for every schema directly nested in ``schema``."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        if key in SCHEMA_KEYWORDS or (key == "items" and isinstance(value, (dict, bool))):
            yield key, value
        elif key in SCHEMA_LIST_KEYWORDS or (key == "items" and isinstance(value, list)):
            if isinstance(value, list):
                yield from ((key, v) for v in value)
        elif key in SCHEMA_MAP_KEYWORDS or key == "dependencies":
            if isinstance(value, dict):
                yield from ((key, v) for v in value.values() if isinstance(v, (dict, bool)))


def keywords_used(schema: Any) -> set[str]:
    """The assertion keywords used anywhere in ``schema``."""
    found, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found |= node.keys() & ASSERTION_KEYWORDS
            stack.extend(child for _, child in subschemas(node))
    return found


@dataclass(frozen=True, slots=True)
class Relaxed:
    schema: Any
    dropped: frozenset[str]  # keywords removed somewhere (enforced by the end check only)


def relax(schema: Any, keep: frozenset[str], formats: frozenset[str] | None = None) -> Relaxed:
    """A copy of ``schema`` without the assertion keywords outside ``keep`` (and without ``format``
    values outside ``formats``, when given). Removing assertions only allows more documents, so
    the relaxed grammar never rejects a valid one; the end check rejects what it lets through."""
    dropped: set[str] = set()

    def drop(key: str, value: Any) -> bool:
        if key in ASSERTION_KEYWORDS and key not in keep:
            dropped.add(key)
            return True
        if key == "format" and formats is not None and value not in formats:
            dropped.add(f"format:{value}")
            return True
        return False

    return Relaxed(_rewrite(schema, drop=drop), frozenset(dropped))


# Upper bounds counted in characters, items or properties of one output. No output comes near
# 2**30 (a context of a million tokens of a few bytes each), and backends refuse or choke on
# bounds past 2**32 (llguidance compiles them into a counted regex), so such a bound is no
# constraint at all and is left out of the grammar (the end check still sees it).
UNREACHABLE = 2**30
_UPPER_BOUNDS = frozenset({"maxLength", "maxItems", "maxProperties", "maxContains"})


def without_unreachable_bounds(schema: Any) -> Any:
    """``schema`` without the upper bounds no output can reach (``UNREACHABLE`` and above): the
    same documents, in a form every backend compiles."""

    def drop(key: str, value: Any) -> bool:
        return key in _UPPER_BOUNDS and isinstance(value, (int, float)) and value >= UNREACHABLE

    return _rewrite(schema, drop=drop)


REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of ``schema`` to be placed at JSON pointer ``base`` (``"/$defs/tool_0"``) inside
    another document, its local references pointing at the same places there: ``#/$defs/City``
    becomes ``#/$defs/tool_0/$defs/City``, ``#`` (the schema itself, a recursive reference)
    becomes ``#/$defs/tool_0``. A ``$recursiveRef`` (always ``#``) becomes a ``$ref`` to the
    schema's new place. Anchors (``#name``) are document-wide and stay; the schema's own ``$id``
    and ``$schema`` are dropped, so its references resolve against the embedding document."""
    if not isinstance(schema, dict):
        return schema

    def rebase(node: dict) -> dict:
        for keyword in REF_KEYWORDS:
            ref = node.get(keyword)
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node[keyword] = "#" + base + ref[1:]
        if isinstance(node.get("$recursiveRef"), str):
            node["$ref"] = node.pop("$recursiveRef")
        return node

    return _rewrite({k: v for k, v in schema.items() if k not in ("$id", "$schema")}, edit=rebase)


# Keywords that add or merge properties from elsewhere: an object under them cannot be closed
# on its own without refusing documents the whole schema allows.
_MERGING = frozenset({"allOf", "if", "then", "else", "dependentSchemas", "dependencies", "unevaluatedProperties",
                      "$dynamicRef", "$recursiveRef"})


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` whose objects take no keys beyond their ``properties`` (xgrammar's
    strict mode, SGLang's default): ``additionalProperties: false`` where a schema lists
    properties and says nothing about other keys. JSON Schema allows unlisted keys, and small
    models fill them with copies of the schema; closing only ever allows *fewer* documents, so
    the end check stays exact. Schemas that merge properties (allOf, if/then, a ``$ref`` beside
    other keywords, ...) or require an unlisted key are returned unchanged."""
    if not isinstance(schema, dict) or keywords_used(schema) & _MERGING:
        return schema
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "$ref" in node and len(node.keys() & ASSERTION_KEYWORDS) > 1:
                return schema
            stack.extend(child for _, child in subschemas(node))
    closed = 0

    def close(node: dict) -> dict:
        nonlocal closed
        props, required = node.get("properties"), node.get("required", [])
        if (isinstance(props, dict) and not node.keys() & {"additionalProperties", "patternProperties"}
                and isinstance(required, list) and set(required) <= props.keys()):
            node["additionalProperties"] = False
            closed += 1
        return node

    out = _rewrite(schema, edit=close)
    return out if closed else schema


def _rewrite(node: Any, drop: Callable[[str, Any], bool] | None = None,
             edit: Callable[[dict], dict] | None = None) -> Any:
    """A copy of a schema: in every schema object, the keys ``drop`` names are left out (their
    subschemas are not visited), subschemas are rewritten, then ``edit`` gets the new object."""
    if isinstance(node, list):
        return [_rewrite(v, drop, edit) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if drop is not None and drop(key, value):
            continue
        if key in SCHEMA_KEYWORDS or key in SCHEMA_LIST_KEYWORDS or key == "items":
            value = _rewrite(value, drop, edit)
        elif key in SCHEMA_MAP_KEYWORDS or key == "dependencies":
            value = {k: _rewrite(v, drop, edit) for k, v in value.items()} if isinstance(value, dict) else value
        out[key] = value
    return out if edit is None else edit(out)
