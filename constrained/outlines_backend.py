"""outlines-core backend: regex and json_schema (compiled to a regex, then to a token index).

outlines-core builds a DFA over the regex and indexes, for every DFA state, which tokens of the
vocabulary may come next (``Index``); a ``Guide`` walks it. The vocabulary is the byte form of
every non-control token (see vocab.py). JSON is compact (no optional whitespace); outlines-core
never allows extra keys, ignores numeric bounds, drops ``pattern`` next to min/maxLength and
rejects some ``format`` values; ``$$ANY$$`` is ``{"type": "object"}`` nested at most 3 deep.
Regexes use Rust's ``regex`` dialect (no lookaround or backreferences) with leftmost-first
alternation: in ``ab|abc`` the second branch is unreachable (write ``abc|ab``).
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import outlines_core as oc
import torch
from outlines_core.json_schema import build_regex_from_schema

from radixlm.constrained.base import (
    ANY_JSON_OBJECT,
    Grammar,
    GrammarBackend,
    GrammarError,
    pop_history,
    utf8_prefix,
)
from radixlm.constrained.bitmask import set_bits, set_only
from radixlm.constrained.vocab import token_bytes

_GUIDE_HISTORY = 1 << 16  # guide steps kept for rollback (a string step is one guide step per byte)
_MAX_JUMP_BYTES = 256
_STOP = -1  # history entry of an accepted stop token


@dataclass(slots=True)
class _Tables:
    """Per-backend vocabulary tables shared by all grammars."""

    stop_ids: tuple[int, ...]
    vocab_size: int
    byte_token: dict[int, int]  # byte value -> the single-byte token id
    first_byte: np.ndarray  # token id -> its first byte, -1 for control tokens


@dataclass(slots=True)
class _Compiled:
    index: oc.Index
    tables: _Tables
    forced: dict[int, str | None] = field(default_factory=dict)  # state -> jump-forward string

    def jump_forward(self, state: int) -> str | None:
        if state not in self.forced:  # racing threads compute the same value; harmless
            self.forced[state] = self._compute_forced(state)
        return self.forced[state]

    def _compute_forced(self, state: int) -> str | None:
        out = bytearray()
        while len(out) < _MAX_JUMP_BYTES and not self.index.is_final_state(state):
            allowed = self.index.get_allowed_tokens(state)
            if not allowed:
                break
            first = self.tables.first_byte[np.asarray(allowed, dtype=np.int64)]
            byte = int(first[0])
            token = self.tables.byte_token.get(byte)
            if byte < 0 or token is None or not (first == byte).all():
                break
            next_state = self.index.get_next_state(state, token)
            if next_state is None:
                break
            out.append(byte)
            state = next_state
        text = utf8_prefix(bytes(out))
        return text or None


class OutlinesBackend(GrammarBackend):
    name = "outlines"
    kinds = frozenset({"json_schema", "regex"})

    def __init__(self, tokenizer: Any, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(tokenizer, vocab_size, **kwargs)
        texts = token_bytes(tokenizer, vocab_size)
        stops = set(self.stop_token_ids)
        mapping: dict[bytes, list[int]] = {}
        first_byte = np.full(vocab_size, -1, dtype=np.int16)
        byte_token: dict[int, int] = {}
        for i, b in enumerate(texts):
            if not b or i in stops:
                continue
            mapping.setdefault(b, []).append(i)
            first_byte[i] = b[0]
            if len(b) == 1:
                byte_token.setdefault(b[0], i)
        self.vocabulary = oc.Vocabulary(self.stop_token_ids[0], mapping)
        self._tables = _Tables(self.stop_token_ids, vocab_size, byte_token, first_byte)

    def _compile(self, kind: str, spec: str) -> _Compiled:
        if kind == "json_schema" and spec == ANY_JSON_OBJECT:
            spec = '{"type": "object"}'
        if kind == "json_schema":
            try:
                json.loads(spec)
            except json.JSONDecodeError as e:
                raise GrammarError(f"invalid json_schema: not valid JSON: {e}") from e
            try:
                regex = build_regex_from_schema(spec, whitespace_pattern="")
            except Exception as e:
                raise GrammarError(f"invalid json_schema: {e}") from e
        else:
            regex = spec
        try:
            index = oc.Index(regex, self.vocabulary)
        except Exception as e:
            raise GrammarError(f"invalid {kind}: {e}{_regex_hint(regex)}") from e
        return _Compiled(index, self._tables)

    def _new_grammar(self, compiled: _Compiled) -> OutlinesGrammar:
        history: deque[int] = deque(maxlen=self.max_rollback_tokens)
        return OutlinesGrammar(compiled, oc.Guide(compiled.index, max_rollback=_GUIDE_HISTORY), history)


class OutlinesGrammar(Grammar):
    __slots__ = ("_compiled", "_guide", "_history", "_path", "_terminated")

    def __init__(self, compiled: _Compiled, guide: oc.Guide, history: deque[int]) -> None:
        self._compiled = compiled
        self._guide = guide
        self._history = history  # per accepted step: guide steps taken, or _STOP
        self._path: list[int] = []  # every token the guide advanced by, to replay in copy()
        self._terminated = False

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        stops = self._compiled.tables.stop_ids
        if self._terminated:
            set_only(bitmask, row, stops)
            return
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not words.is_contiguous():
            raise ValueError("fill_mask needs a contiguous CPU int32 bitmask")
        words.zero_()
        self._guide.write_mask_into(words.data_ptr(), words.numel(), 4)
        set_bits(bitmask, row, stops, self._guide.is_finished())

    def accept(self, token_id: int) -> bool:
        if self._terminated or not 0 <= token_id < self._compiled.tables.vocab_size:
            return False
        if token_id in self._compiled.tables.stop_ids:
            if not self._guide.is_finished():
                return False
            self._terminated = True
            self._history.append(_STOP)
            return True
        if self._compiled.index.get_next_state(self._guide.get_state(), token_id) is None:
            return False
        self._guide.advance(token_id, return_tokens=False)
        self._path.append(token_id)
        self._history.append(1)
        return True

    def is_terminated(self) -> bool:
        return self._terminated

    def jump_forward(self) -> str | None:
        if self._terminated:
            return None
        return self._compiled.jump_forward(self._guide.get_state())

    def accept_string(self, text: str) -> bool:
        if self._terminated:
            return False
        index, byte_token = self._compiled.index, self._compiled.tables.byte_token
        state, tokens = self._guide.get_state(), []
        for byte in text.encode():
            token = byte_token.get(byte)
            state = None if token is None else index.get_next_state(state, token)
            if state is None:
                return False
            tokens.append(token)
        for token in tokens:
            self._guide.advance(token, return_tokens=False)
        self._path.extend(tokens)
        self._history.append(len(tokens))
        return True

    def rollback(self, k: int) -> None:
        for steps in pop_history(self._history, k):
            if steps == _STOP:
                self._terminated = False
            elif steps:
                self._guide.rollback_state(steps)
                del self._path[-steps:]

    def copy(self) -> OutlinesGrammar:
        # A new guide replaying the path: deepcopy would serialize the whole index.
        guide = oc.Guide(self._compiled.index, max_rollback=_GUIDE_HISTORY)
        for token in self._path:
            guide.advance(token, return_tokens=False)
        twin = OutlinesGrammar(self._compiled, guide, self._history.copy())
        twin._path = self._path.copy()
        twin._terminated = self._terminated
        return twin


def _regex_hint(regex: str) -> str:
    if re.search(r"\(\?<?[=!]", regex):
        return " (lookaround is not supported)"
    try:
        re.compile(regex)
    except re.error as e:
        return f" ({e})"
    return ""
