"""Constrained decoding: compile regex / JSON schema / EBNF / structural-tag specs into grammars
that mask the vocabulary each step.

    backend = create_grammar_backend("xgrammar", tokenizer, vocab_size)
    future = backend.compile_async("json_schema", spec)   # never blocks the decode loop
    grammar = future.result()                             # GrammarError for a bad spec
    bitmask = backend.allocate_bitmask(batch_size)
    grammar.fill_mask(bitmask, row); backend.apply_bitmask(logits, bitmask)
    grammar.accept(token_id)                              # ... until grammar.is_terminated()

Backends (imported lazily, so the unused one need not be installed):
- ``llguidance`` (the server's default): json_schema, regex, ebnf, structural_tag
- ``xgrammar``: json_schema, regex, ebnf, structural_tag
- ``outlines``: json_schema, regex
The json_schema spec ``$$ANY$$`` (ANY_JSON_OBJECT) means any JSON object.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from radixlm.constrained.base import ANY_JSON_OBJECT, CacheInfo, Grammar, GrammarBackend, GrammarError

_BITMASK_HELPERS = ("allocate_bitmask", "apply_bitmask", "bitmask_to_bool")


def __getattr__(name: str) -> Any:
    """The bitmask helpers, imported on first use: they need torch, which the HTTP process never imports."""
    if name in _BITMASK_HELPERS:
        return getattr(importlib.import_module("radixlm.constrained.bitmask"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

BACKENDS = {
    "xgrammar": "radixlm.constrained.xgrammar_backend:XGrammarBackend",
    "outlines": "radixlm.constrained.outlines_backend:OutlinesBackend",
    "llguidance": "radixlm.constrained.llguidance_backend:LLGuidanceBackend",
}


def create_grammar_backend(
    name: str,
    tokenizer: Any,
    vocab_size: int,
    *,
    cache_size: int = 256,
    num_threads: int = 2,
    stop_token_ids: Iterable[int] = (),
    max_rollback_tokens: int = 256,
) -> GrammarBackend:
    """Build a backend; its tokenizer tables are built once here (the expensive part).

    ``vocab_size`` is the model's (logits) vocabulary, which may exceed the tokenizer's; ids past
    the tokenizer are never allowed. The stop tokens are ``tokenizer.eos_token_id`` plus
    ``stop_token_ids``. ``max_rollback_tokens``: how many steps the outlines backend keeps for
    rollback (xgrammar keeps all)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(
        tokenizer,
        vocab_size,
        cache_size=cache_size,
        num_threads=num_threads,
        stop_token_ids=stop_token_ids,
        max_rollback_tokens=max_rollback_tokens,
    )


__all__ = [
    "ANY_JSON_OBJECT",
    "BACKENDS",
    "CacheInfo",
    "Grammar",
    "GrammarBackend",
    "GrammarError",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_to_bool",
    "create_grammar_backend",
]
