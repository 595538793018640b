"""`$ref` checks of a JSON schema before it is compiled.

Backends resolve local references themselves, but two kinds of `$ref` must never reach them:
an external one (``file:///etc/passwd``, ``https://...``: never fetched, never opened; backends
silently ignored it) and a cycle of references with no content (``{"$defs": {"a": {"$ref":
"#/$defs/a"}}, "$ref": "#/$defs/a"}``), which compiles to a grammar that accepts nothing. Both are
a GrammarError naming the reference. A local reference that does not resolve is one too.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from radixlm.constrained.base import GrammarError

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
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise GrammarError(f"invalid json_schema: $ref {ref!r} is not a local reference (#/...); external "
                               "references are never fetched")
        target = _resolve(schema, ref)
        seen = [ref]
        while isinstance(target, dict) and isinstance(target.get("$ref"), str) and target.keys() <= _ANNOTATIONS:
            nxt = target["$ref"]
            if nxt in seen:
                chain = " -> ".join([*seen, nxt])
                raise GrammarError(f"invalid json_schema: $ref cycle {chain} has no content, so no value matches it")
            seen.append(nxt)
            target = _resolve(schema, nxt) if nxt.startswith("#") else None


def _refs(schema: Any) -> list[str]:
    """Every `$ref` string in the document (iterative: depth is bounded by the caller's limits)."""
    found, stack = [], [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str):
                found.append(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


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
