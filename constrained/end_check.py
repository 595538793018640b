"""The end check of JSON-schema grammars: a document may end only if it validates.

Every backend's ``json_schema`` grammar is wrapped in :class:`EndCheckedGrammar`. It passes every
call through to the backend's grammar and keeps the bytes accepted so far; whenever the backend
would allow a stop token (the document could end here), the document is validated with
``jsonschema`` against the original schema, and the stop tokens are masked out (and refused by
``accept``) if it does not validate. Stop tokens are only allowed where a complete JSON value
ends, so this runs once or a few times per request.

If the backend's grammar is looser than the schema (keywords it cannot express, see
``json_schema.py``), a model can reach a complete document that violates the schema and that the
grammar cannot extend: a dead end. Then only the stop tokens are left in the mask (a mask must
never be empty) and ``accept`` refuses them, so the request ends with an error
(``error_message``) instead of an invalid document.

The schema is the client's: its references resolve only inside the document (nothing is ever
fetched) and its patterns run bounded (``patterns.py``). The verdict on a document that could end
is computed as soon as the token completing it is accepted; when its patterns need more than the
inline budget, the check goes to the pattern pool and :meth:`EndCheckedGrammar.pending_check`
hands the scheduler a Future to park the request on until the verdict is in.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import jsonschema
import referencing.exceptions
import regex
import torch

from radixlm.constrained.base import Grammar, GrammarError
from radixlm.constrained.bitmask import bit_is_set, set_bits, set_only
from radixlm.constrained.json_schema import make_validator, subschemas
from radixlm.constrained.patterns import compile_pattern, install_jsonschema_hook, result_of, run_bounded

install_jsonschema_hook()
_VALUE_ENDS = frozenset(b'}]"0123456789el')  # last byte of a complete JSON value (true, false, null)
_QUOTE, _BACKSLASH, _OPENS, _CLOSES = 0x22, 0x5C, frozenset(b"{["), frozenset(b"}]")


def lex_after(state: int, data: bytes) -> int:
    """The JSON lexer's state after ``data``: depth << 2 | in a string (2) | after a backslash in one (1).
    A document can be complete only at depth 0 outside a string; tracking that keeps the end check from
    parsing the whole document again at every closing quote or digit inside it (quadratic in its length)."""
    depth, in_string, escaped = state >> 2, state & 2, state & 1
    for b in data:
        if in_string:
            if escaped:
                escaped = 0
            elif b == _BACKSLASH:
                escaped = 1
            elif b == _QUOTE:
                in_string = 0
        elif b == _QUOTE:
            in_string = 2
        elif b in _OPENS:
            depth += 1
        elif b in _CLOSES:
            depth -= 1
    return depth << 2 | in_string | escaped


def can_end(state: int) -> bool:
    """Whether a document whose lexer state is ``state`` can be complete: depth 0, outside a string."""
    return state >> 2 <= 0 and not state & 2


class SchemaCheck:
    """Validates complete documents against one schema (shared by all grammars of the schema)."""

    def __init__(self, schema: Any, dropped: frozenset[str] = frozenset()) -> None:
        _check_patterns(schema)
        self.validator = make_validator(schema)
        self.dropped = dropped  # keywords only this check enforces (the grammar was relaxed)

    def violation(self, document: bytes) -> str | None:
        """None if ``document`` is JSON that validates, else why not. Raises GrammarError when the
        schema cannot judge it (a reference that does not resolve; PatternTimeout past a bound)."""
        try:
            value = json.loads(document)
        except (ValueError, RecursionError) as e:
            return f"not a JSON document: {e}"
        try:
            error = jsonschema.exceptions.best_match(self.validator.iter_errors(value))
        except (RecursionError, regex.error) as e:
            return f"cannot be validated: {e}"
        except referencing.exceptions.Unresolvable as e:
            ref = getattr(e, "ref", None) or str(e)
            raise GrammarError(f"invalid json_schema: reference {str(ref)[:200]!r} does not resolve inside the "
                               "schema (references are never fetched)") from None
        if error is None:
            return None
        where = "/".join(str(p) for p in error.absolute_path)
        return f"{error.message[:200]}" + (f" (at /{where})" if where else "")


def _check_patterns(schema: Any) -> None:
    """The validator matches ``pattern`` / ``patternProperties`` with the ``regex`` module: a
    pattern it cannot compile would make every document unverifiable, so such a schema is rejected."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += list(node["patternProperties"])
        for p in patterns:
            try:
                compile_pattern(p)
            except (regex.error, RecursionError, OverflowError) as e:
                raise GrammarError(f"invalid json_schema: pattern {p!r} is not supported: {e}") from e
        stack.extend(child for _, child in subschemas(node))


class EndCheckedGrammar(Grammar):
    __slots__ = ("_inner", "_check", "_token_bytes", "_stop_ids", "_doc", "_steps", "_lex", "_verdict",
                 "_pending", "_slow", "error_message")

    def __init__(self, inner: Grammar, check: SchemaCheck, token_bytes: list[bytes | None],
                 stop_ids: tuple[int, ...]) -> None:
        self._inner = inner
        self._check = check
        self._token_bytes = token_bytes
        self._stop_ids = stop_ids
        self._doc = bytearray()
        self._steps: list[int] = []  # bytes added by each accepted step (for rollback)
        self._lex: list[int] = []  # lex_after's state after each accepted step
        self._verdict: str | None | bool | GrammarError = False  # False = not validated since the last change
        self._pending: Future | None = None  # the verdict, computed on the pattern pool
        self._slow = False  # a check needed the pool once: the next ones go straight there
        self.error_message: str | None = None  # set when the document cannot end validly

    def _judge(self) -> Any:
        """The check of the current document: its verdict, a GrammarError, or a Future of it."""
        doc = bytes(self._doc)
        try:
            verdict = run_bounded(lambda: self._check.violation(doc), inline=not self._slow)
        except GrammarError as e:
            return e
        self._slow = self._slow or isinstance(verdict, Future)
        return verdict

    def _violation(self) -> str | None:
        if self._pending is not None:  # the scheduler parked the request until this was done
            try:
                self._verdict = self._pending.result()
            except GrammarError as e:
                self._verdict = e
            self._pending = None
        if self._verdict is False:
            try:  # not judged when accepted: judge now (bounded, waiting if it must)
                self._verdict = result_of(self._judge())
            except GrammarError as e:
                self._verdict = e
        if isinstance(self._verdict, GrammarError):
            raise self._verdict
        return self._verdict  # type: ignore[return-value]

    def pending_check(self) -> Future | None:
        """A verdict still being computed off-thread: the request must not take a step before it is done."""
        return self._pending

    def batch_target(self) -> Grammar | None:
        return self._inner.batch_target()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._inner.fill_mask(bitmask, row)
        if self._inner.is_terminated() or not bit_is_set(bitmask, row, self._stop_ids):
            return
        why = self._violation()
        if why is None:
            return
        set_bits(bitmask, row, self._stop_ids, False)
        if not bool(bitmask[row].any()):  # a complete, invalid document the grammar cannot extend
            self.error_message = self._explain(f"the output violates the JSON schema and cannot continue: {why}")
            set_only(bitmask, row, self._stop_ids)  # never an empty mask; accept() refuses them

    def accept(self, token_id: int) -> bool:
        is_stop = token_id in self._stop_ids
        if is_stop and not self._inner.is_terminated() and self._violation() is not None:
            self.error_message = self.error_message or self._explain(
                f"the output violates the JSON schema: {self._violation()}")
            return False
        if not self._inner.accept(token_id):
            return False
        data = b"" if is_stop else (self._token_bytes[token_id] or b"")
        self._push(data)
        return True

    def accept_string(self, text: str) -> bool:
        if not self._inner.accept_string(text):
            return False
        self._push(text.encode())
        return True

    def _explain(self, message: str) -> str:
        dropped = sorted(self._check.dropped)
        if dropped:
            message += (f" (this backend's grammar cannot express {', '.join(dropped)}; only the final check "
                        "enforces them)")
        return message

    def _push(self, data: bytes) -> None:
        self._doc += data
        self._steps.append(len(data))
        state = lex_after(self._lex[-1] if self._lex else 0, data)
        self._lex.append(state)
        self._verdict, self._pending = False, None
        if not data or not can_end(state):  # were the lexer ever wrong, _violation still judges before a stop
            return
        end = self._doc.rstrip()
        if end and end[-1] in _VALUE_ENDS:  # the document may be complete: judge it now
            verdict = self._judge()
            if isinstance(verdict, Future):
                self._pending = verdict
            else:
                self._verdict = verdict

    def is_terminated(self) -> bool:
        return self._inner.is_terminated()

    def jump_forward(self) -> str | None:
        return self._inner.jump_forward()

    def rollback(self, k: int) -> None:
        if not 0 <= k <= len(self._steps):
            raise ValueError(f"can roll back 0..{len(self._steps)} steps, not {k}")
        self._inner.rollback(k)
        for _ in range(k):
            n = self._steps.pop()
            self._lex.pop()
            if n:
                del self._doc[-n:]
        self._verdict, self._pending = False, None
        self.error_message = None

    def copy(self) -> EndCheckedGrammar:
        twin = EndCheckedGrammar(self._inner.copy(), self._check, self._token_bytes, self._stop_ids)
        twin._doc, twin._steps, twin._lex = bytearray(self._doc), list(self._steps), list(self._lex)
        twin._verdict, twin._pending, twin.error_message = self._verdict, self._pending, self.error_message
        twin._slow = self._slow
        return twin

    @property
    def document(self) -> bytes:
        """The bytes accepted so far."""
        return bytes(self._doc)

    @property
    def inner(self) -> Grammar:
        """The backend's grammar (without the end check)."""
        return self._inner

    @property
    def relaxed_keywords(self) -> frozenset[str]:
        """Keywords the backend's grammar leaves out, enforced by the end check alone."""
        return self._check.dropped
