"""Reference checks of a JSON schema before it is compiled (`$ref`, `$dynamicRef`, `$recursiveRef`).

Backends resolve local references themselves and the end check resolves them in a registry that
retrieves nothing, but three kinds must never get that far: an external one (``file:///etc/passwd``,
``https://...``: never fetched, never opened; backends silently ignored it), one that does not
resolve inside the document (a JSON pointer to nothing, an anchor no subschema declares), and a
cycle of references with no content (``{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref":
"#/$defs/a"}``), which compiles to a grammar that accepts nothing. Each is a GrammarError (a 400)
naming the reference.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from radixlm.constrained.base import GrammarError
from radixlm.constrained.json_schema import REF_KEYWORDS

# keys that carry no constraint: a schema made of these and a $ref is only an alias of its target
_ANNOTATIONS = frozenset({"$ref", "$defs", "definitions", "$id", "$schema", "$comment", "$anchor", "title",
                          "description", "default", "examples", "deprecated", "readOnly", "writeOnly"})


def check_schema_refs(spec: str) -> None:
    """GrammarError for an external, unresolvable or contentless circular `$ref` in `spec` (a JSON
    string; one that does not parse is left to the backend's own message)."""
    try:
        schema = json.loads(spec)
    except ValueError:
        return
    refs, anchors = _refs(schema)
    for keyword, ref in refs:
        if not ref.startswith("#"):
            raise GrammarError(f"invalid json_schema: {keyword} {ref[:200]!r} is not a local reference (#/... or "
                               "#anchor); external references are never fetched")
        if keyword == "$recursiveRef" and ref != "#":
            raise GrammarError(f"invalid json_schema: $recursiveRef must be '#', got {ref[:200]!r}")
        name = unquote(ref[1:])
        if name and not name.startswith("/") and name not in anchors:
            raise GrammarError(f"invalid json_schema: {keyword} {ref[:200]!r} names an anchor no subschema declares "
                               "($anchor / $dynamicAnchor)")
        if keyword != "$ref":
            continue
        target = _resolve(schema, ref)
        seen = [ref]
        while isinstance(target, dict) and isinstance(target.get("$ref"), str) and target.keys() <= _ANNOTATIONS:
            nxt = target["$ref"]
            if nxt in seen:
                chain = " -> ".join([*seen, nxt])
                raise GrammarError(f"invalid json_schema: $ref cycle {chain} has no content, so no value matches it")
            seen.append(nxt)
            target = _resolve(schema, nxt) if nxt.startswith("#") else None


def check_structural_tag_refs(spec: str) -> None:
    """check_schema_refs for every schema of a structural tag (SGLang's legacy form or a format
    object); a spec that does not parse is left to the backend's own message."""
    try:
        tag = json.loads(spec)
    except ValueError:
        return
    structures = tag.get("structures") if isinstance(tag, dict) else None
    for s in structures if isinstance(structures, list) else []:
        schema = s.get("schema") if isinstance(s, dict) else None
        if isinstance(schema, (dict, str)):
            check_schema_refs(schema if isinstance(schema, str) else json.dumps(schema))


def _refs(schema: Any) -> tuple[list[tuple[str, str]], set[str]]:
    """Every (keyword, reference) in the document, and the anchor names it declares ($anchor,
    $dynamicAnchor, and draft 6/7's ``$id: "#name"``). Iterative: depth is bounded by the caller's
    limits. A reference that is not a string is left to the meta-schema check."""
    found, anchors, stack = [], set(), [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for keyword in REF_KEYWORDS:
                ref = item.get(keyword)
                if isinstance(ref, str):
                    found.append((keyword, ref))
            for keyword in ("$anchor", "$dynamicAnchor"):
                if isinstance(item.get(keyword), str):
                    anchors.add(item[keyword])
            if isinstance(item.get("$id"), str) and item["$id"].startswith("#"):
                anchors.add(item["$id"][1:])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found, anchors


def _resolve(schema: Any, ref: str) -> Any:
    """The value a local `#/a/b` pointer names; GrammarError if there is none."""
    node = schema
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):  # a named $anchor: left to the backend
        return None
    if pointer:
        for part in pointer.lstrip("/").split("/"):
            key = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and key in node:
                node = node[key]
            elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
                node = node[int(key)]
            else:
                raise GrammarError(f"invalid json_schema: $ref {ref!r} does not resolve to anything in the schema")
    return node
