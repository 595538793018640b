"""xgrammar backend: json_schema, regex, ebnf and structural_tag.

- json_schema: compact JSON (no optional whitespace, separators ``,`` and ``:``) in xgrammar's
  strict mode: an object that lists ``properties`` gets no other keys unless
  ``additionalProperties`` allows them, an array with ``prefixItems`` no further items unless
  ``items`` allows them. Outputs are short and jump-forward strings long. Known xgrammar gaps:
  ``maxLength`` is not enforced next to ``pattern``; untyped nested values (``{}``) use ``, ``
  between items. The spec ``$$ANY$$`` means any compact JSON object.
- regex: xgrammar's regex dialect (ECMAScript-like; no lookaround or backreferences).
- ebnf: GBNF as xgrammar reads it, root rule ``root``.
- structural_tag: a JSON string, either xgrammar's format
  ``{"type": "structural_tag", "format": {...}}`` or SGLang's legacy one
  ``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}``
  (free text until a trigger, then ``begin`` + JSON per ``schema`` + ``end``).

Control tokens (special added tokens such as ``<|im_start|>``) are blanked out of the vocabulary
xgrammar sees, so no grammar ever allows them; the stop tokens are allowed only at the end.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from radixlm.constrained.base import ANY_JSON_OBJECT, Grammar, GrammarBackend, GrammarError
from radixlm.constrained.bitmask import set_only
from radixlm.constrained.vocab import special_token_ids

# Any compact JSON object. xgrammar's schema {"type": "object"} would do, but its generic JSON
# rules put ", " between nested items even with separators=(",", ":").
_ANY_OBJECT_EBNF = r"""
root ::= object
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" (string ":" value ("," string ":" value)*)? "}"
array ::= "[" (value ("," value)*)? "]"
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
"""
_LOG_PREFIX = re.compile(r"^\[[\d:. ]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"
    kinds = frozenset({"json_schema", "regex", "ebnf", "structural_tag"})

    def __init__(self, tokenizer: Any, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(tokenizer, vocab_size, **kwargs)
        # Built once: the byte form of every token, with control tokens blanked ("" = never allowed).
        detected = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(self.stop_token_ids)
        )
        blank = special_token_ids(tokenizer) - set(self.stop_token_ids)
        encoded = [b"" if i in blank else tok for i, tok in enumerate(detected.decoded_vocab)]
        self.tokenizer_info = xgr.TokenizerInfo(
            encoded,
            vocab_type=xgr.VocabType.RAW,
            vocab_size=vocab_size,
            stop_token_ids=list(self.stop_token_ids),
            add_prefix_space=False,
        )
        # our LRU is the cache; xgrammar's own would hold a second copy
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=kwargs.get("num_threads", 2), cache_enabled=False
        )

    def _compile(self, kind: str, spec: str) -> xgr.CompiledGrammar:
        if kind == "json_schema" and spec == ANY_JSON_OBJECT:
            return self._compiler.compile_grammar(_ANY_OBJECT_EBNF)
        if kind == "json_schema":
            _parse_json(kind, spec)
            return self._compiler.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
        if kind == "regex":
            return self._compiler.compile_regex(spec)
        if kind == "ebnf":
            return self._compiler.compile_grammar(spec, root_rule_name="root")
        return self._compiler.compile_structural_tag(_structural_tag(_parse_json(kind, spec)))

    @staticmethod
    def _clean_message(message: str) -> str:
        lines = [_CHECK_FAILED.sub("", _LOG_PREFIX.sub("", line)) for line in message.strip().splitlines()]
        return " ".join(line.strip() for line in lines if line.strip())

    def _new_grammar(self, compiled: xgr.CompiledGrammar) -> XGrammarGrammar:
        # rollback history is unlimited in xgrammar (max_rollback_tokens is deprecated there)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(self.stop_token_ids))
        return XGrammarGrammar(matcher, self.stop_token_ids, self.vocab_size)


class XGrammarGrammar(Grammar):
    __slots__ = ("_matcher", "_stop_ids", "_vocab_size")

    def __init__(self, matcher: xgr.GrammarMatcher, stop_ids: tuple[int, ...], vocab_size: int) -> None:
        self._matcher = matcher
        self._stop_ids = stop_ids
        self._vocab_size = vocab_size

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            set_only(bitmask, row, self._stop_ids)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        if not 0 <= token_id < self._vocab_size:
            return False
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def jump_forward(self) -> str | None:
        if self._matcher.is_terminated():
            return None
        return self._matcher.find_jump_forward_string() or None

    def accept_string(self, text: str) -> bool:
        if self._matcher.is_terminated():
            return False
        return self._matcher.accept_string(text)

    def rollback(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"cannot roll back {k} steps")
        if k:
            try:
                self._matcher.rollback(k)
            except RuntimeError as e:
                message = XGrammarBackend._clean_message(str(e))
                raise ValueError(f"cannot roll back {k} steps: {message}") from e

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self._matcher.fork(), self._stop_ids, self._vocab_size)


def _parse_json(kind: str, spec: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid {kind}: not valid JSON: {e}") from e


def _structural_tag(tag: Any) -> str:
    """The structural tag as xgrammar's current JSON format (legacy ``structures`` converted)."""
    if not isinstance(tag, dict):
        raise GrammarError("invalid structural_tag: expected a JSON object")
    if "structures" not in tag:
        return json.dumps(tag)  # xgrammar validates {"type": "structural_tag", "format": ...}
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise GrammarError("invalid structural_tag: 'structures' and 'triggers' must be lists")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not {"begin", "schema", "end"} <= s.keys():
            raise GrammarError(f"invalid structural_tag: structures[{i}] needs 'begin', 'schema' and 'end'")
        schema = json.loads(s["schema"]) if isinstance(s["schema"], str) else s["schema"]
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": s["begin"], "content": content, "end": s["end"]})
    fmt = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return json.dumps({"type": "structural_tag", "format": fmt})
