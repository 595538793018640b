"""llguidance backend: json_schema, regex, ebnf (GBNF or Lark) and structural_tag.

llguidance (Microsoft/guidance-ai, Rust) compiles a grammar lazily: a "compile" builds the
grammar and its lexer in milliseconds, and each mask is computed on demand by a derivative-based
lexer plus an Earley parser over the token trie. JSON is compact (no optional whitespace,
separators ``,`` and ``:``); properties come in schema order; objects take no unlisted keys where
that is safe (``json_schema.close_objects``: xgrammar's strict mode, SGLang's default).

JSON schema: llguidance's compiler either expresses a keyword exactly or refuses the schema
(``allOf`` intersections, ``anyOf``, ``$ref``, ``patternProperties``, numeric bounds and
``multipleOf``, string lengths and patterns, the formats in ``FORMATS``...). Keywords it refuses
(``not``, ``if``/``then``/``else``, ``dependencies``, ``contains``, ``uniqueItems``,
``propertyNames``, unknown formats; ``oneOf`` whose branches it cannot prove disjoint is compiled
as ``anyOf``) are relaxed away, level by level (``RELAX_LEVELS``), and enforced by the end check
(see ``json_schema.py`` and ``end_check.py``). A schema that fails even at the last level is
rejected with llguidance's message for the first level.

structural_tag: SGLang's legacy form (``structures`` + ``triggers``) only: free text, and after a
trigger ``begin`` + JSON per ``schema`` (whitespace allowed, as xgrammar does) + ``end``
(llguidance's lazy lexemes).
"""

from __future__ import annotations

import json
import os
from collections import deque
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher, StructTag

from radixlm.constrained.base import (
    ANY_JSON_OBJECT,
    Grammar,
    GrammarBackend,
    GrammarError,
    pop_history,
    utf8_prefix,
)
from radixlm.constrained.bitmask import set_bits, set_bits_of_rows, set_only
from radixlm.constrained.json_schema import close_objects, keywords_used, relax

_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":", "lenient": False}
_STOP = -1  # history entry of an accepted stop token

# What llguidance's JSON compiler expresses (llguidance 1.x, docs/json_schema.md).
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
_LEVEL1 = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "items", "prefixItems", "additionalItems",
    "minItems", "maxItems", "properties", "additionalProperties", "patternProperties", "required",
    "minProperties", "maxProperties", "minLength", "maxLength", "pattern", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# Each level keeps fewer keywords (and formats); the end check enforces what a level drops.
RELAX_LEVELS: tuple[tuple[frozenset[str], frozenset[str]], ...] = (
    (_LEVEL1, FORMATS),
    (_LEVEL1 - {"patternProperties", "minProperties", "maxProperties", "pattern", "multipleOf"}, FORMATS),
    (frozenset({"type", "enum", "const", "anyOf", "$ref", "items", "prefixItems", "properties",
                "additionalProperties", "required"}), frozenset()),
)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"
    kinds = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})

    def __init__(self, tokenizer: Any, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(tokenizer, vocab_size, **kwargs)
        try:
            self.lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                            eos_token=list(self.stop_token_ids))
        except ValueError:  # a slow (Python) tokenizer: describe its vocabulary byte by byte
            self.lltokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_ByteVocab(tokenizer, self)), n_vocab=vocab_size,
                eos_token=list(self.stop_token_ids))
        self._executor: llguidance.LLExecutor | None = None  # made on the first batch of masks
        self._round = 0  # fill_rows calls so far: a row it computed counts for its own round only

    # -- compiling -------------------------------------------------------------------------------

    def _matcher(self, grammar: str) -> LLMatcher:
        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def _compile(self, kind: str, spec: str) -> LLMatcher:
        if kind == "json_schema":  # only ANY_JSON_OBJECT gets here (see _compile_json_schema)
            assert spec == ANY_JSON_OBJECT
            return self._matcher(LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_COMPACT))
        if kind == "regex":
            return self._matcher(LLMatcher.grammar_from_regex(spec))
        if kind == "ebnf":
            return self._matcher(llguidance.grammar_from("ebnf", spec))
        return self._matcher(_structural_tag_lark(spec))

    def _compile_json_schema(self, schema: Any, spec: str) -> tuple[LLMatcher, frozenset[str]]:
        first_error = None
        # oneOf whose branches llguidance cannot prove disjoint is refused unless coerced to anyOf
        coercions = [False, True] if "oneOf" in keywords_used(schema) else [False]
        closed = close_objects(schema)  # strict objects first, the schema as written if they fail
        for base in [closed, schema] if closed is not schema else [schema]:
            for keep, formats in RELAX_LEVELS:
                relaxed = relax(base, keep, formats)
                text = json.dumps(relaxed.schema)
                for coerce in coercions:
                    overrides = {**_COMPACT, "coerce_one_of": coerce}
                    grammar = LLMatcher.grammar_from_json_schema(text, overrides=overrides)
                    try:
                        return self._matcher(grammar), relaxed.dropped | ({"oneOf"} if coerce else set())
                    except GrammarError as e:
                        first_error = first_error or e
        raise GrammarError(f"invalid json_schema: {first_error}")

    def _new_grammar(self, compiled: LLMatcher) -> LLGuidanceGrammar:
        history: deque[int] = deque(maxlen=self.max_rollback_tokens)
        return LLGuidanceGrammar(compiled.deep_copy(), self, history)

    def fill_rows(self, targets: list[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        """The rows' masks computed by llguidance's executor: one call for the batch, on a thread per
        core with the GIL released (a mask is ~50-200 us of one core each)."""
        self._round += 1
        ours = [(g, row) for g, row in targets if isinstance(g, LLGuidanceGrammar)]
        if len(ours) < 2 or bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or \
                not bitmask.is_contiguous():
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=os.cpu_count() or 1)
        self._executor.unsafe_compute_mask_ptr([(g._m, row) for g, row in ours], bitmask.data_ptr(),
                                               bitmask.shape[1] * 4, bitmask.shape[0])
        # the stop tokens allowed exactly where the document may end, as fill_mask does for one row
        set_bits_of_rows(bitmask, [row for _, row in ours], self.stop_token_ids,
                         [g._m.is_accepting() for g, _ in ours])
        for g, row in ours:
            g._filled = (row, self._round)


class LLGuidanceGrammar(Grammar):
    __slots__ = ("_m", "_backend", "_history", "_terminated", "_filled")

    def __init__(self, matcher: LLMatcher, backend: LLGuidanceBackend, history: deque[int]) -> None:
        self._m = matcher
        self._backend = backend
        self._history = history  # per accepted step: tokens consumed, or _STOP
        self._terminated = False
        self._filled: tuple[int, int] | None = None  # (row, round) the backend's fill_rows just computed

    def batch_target(self) -> Grammar | None:
        return None if self._terminated or self._m.is_error() else self

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        stops = self._backend.stop_token_ids
        filled, self._filled = self._filled == (row, self._backend._round), None
        if self._terminated or self._m.is_error():
            set_only(bitmask, row, stops)
            return
        if filled:  # by fill_rows, stop tokens included
            return
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not words.is_contiguous():
            raise ValueError("fill_mask needs a contiguous CPU int32 bitmask")
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        set_bits(bitmask, row, stops, self._m.is_accepting())

    def accept(self, token_id: int) -> bool:
        backend = self._backend
        if self._terminated or not 0 <= token_id < backend.vocab_size:
            return False
        if token_id in backend.stop_token_ids:
            if not self._m.is_accepting():
                return False
            self._terminated = True
            self._history.append(_STOP)
            return True
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        self._history.append(1)
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def jump_forward(self) -> str | None:
        if self._terminated or self._m.is_error():
            return None
        return utf8_prefix(self._m.compute_ff_bytes()) or None

    def accept_string(self, text: str) -> bool:
        if self._terminated or not text:
            return False
        tokens = self._backend.lltokenizer.tokenize_str(text)
        done = self._m.try_consume_tokens(tokens)
        if done != len(tokens):
            if done:
                self._m.rollback(done)
            return False
        self._history.append(len(tokens))
        return True

    def rollback(self, k: int) -> None:
        for steps in pop_history(self._history, k):
            if steps == _STOP:
                self._terminated = False
            elif steps:
                self._m.rollback(steps)

    def copy(self) -> LLGuidanceGrammar:
        twin = LLGuidanceGrammar(self._m.deep_copy(), self._backend, self._history.copy())
        twin._terminated = self._terminated
        return twin


def _structural_tag_lark(spec: str) -> str:
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid structural_tag: not valid JSON: {e}") from e
    if not isinstance(tag, dict) or "structures" not in tag:
        raise GrammarError("invalid structural_tag: the llguidance backend takes SGLang's form "
                           "{'structures': [{'begin', 'schema', 'end'}], 'triggers': [...]}")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not structures:
        raise GrammarError("invalid structural_tag: 'structures' and 'triggers' must be non-empty lists")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise GrammarError(f"invalid structural_tag: structures[{i}] needs 'begin', 'schema' and 'end'")
        trigger = next((t for t in triggers if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"invalid structural_tag: no trigger starts structures[{i}].begin {s['begin']!r}")
        schema = json.loads(s["schema"]) if isinstance(s["schema"], str) else s["schema"]
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return StructTag.to_grammar(tags, assume_special=False)


class _ByteVocab:
    """What llguidance.TokenizerWrapper reads from a tokenizer, built from our byte table."""

    def __init__(self, tokenizer: Any, backend: GrammarBackend) -> None:
        table = backend.token_bytes()
        self.tokens = [b if b is not None else b"" for b in table]
        self.special_token_ids = [i for i, b in enumerate(table) if b is None]
        self.eos_token_id = backend.stop_token_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))
