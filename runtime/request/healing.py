"""Token healing (sampling param ``token_healing``, off by default): the prompt-boundary fix.

A prompt that ends mid-word or in a space ("The capital of France is ") ends on a token the
model rarely saw there: in training the space was part of the next word's token (" Paris"), so
the model must now continue with "Paris", an unnatural tokenization, and small models derail.
Healing backs off the prompt's last token and constrains the first generated token(s) to spell
out its bytes first: the model picks " Paris" itself. The output text leaves out the backed-off
text (the prompt already has it), so prompt + output reads as without healing.

How it runs in the scheduler:
- ``start_healing`` (when the request is queued): drops the last prompt token into ``req.healing``
  when it is plain text (not a control token, complete UTF-8).
- ``HealingGrammar`` wraps the request's grammar (or none): while the backed-off bytes are
  pending, a token is allowed if its bytes are a prefix of them (then the rest is still pending)
  or start with them; the part past them must be accepted by the request's own grammar (a regex,
  JSON schema...), so healing composes with constraints. Once the bytes are out, the wrapper is
  unwrapped (``settled``) and the request's grammar continues alone.
- The detokenizer and the stop-string check leave the healed text out of the output
  (``healed_text``, ``output_tail``).
Counted in meta_info: prompt_tokens no longer includes the backed-off token; the first output
token includes its text.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.constrained.base import Grammar
from radixlm.constrained.bitmask import bitmask_to_bool, bool_to_bitmask, ids_to_bitmask

FULL_CHECK_BUDGET = 256  # candidates per mask whose remainder needs a multi-token grammar check


@dataclass(frozen=True, slots=True)
class TokenHealing:
    removed: int  # the backed-off prompt token
    data: bytes  # its bytes, which the output must start with
    text: str  # the same, as text (left out of the output text)


@dataclass(slots=True)
class _Candidates:
    prefix_ids: torch.Tensor  # tokens whose bytes are a non-empty prefix of the pending bytes
    ext_ids: torch.Tensor  # tokens that start with the pending bytes and go further
    ext_rest: list[bytes]  # ... the part past them
    ext_rest_token: torch.Tensor  # ... that part's token id when it is one token, else -1


@dataclass
class HealingVocab:
    """Token bytes of one tokenizer plus per-prefix candidate sets (cached)."""

    token_bytes: list[bytes | None]
    by_bytes: dict[bytes, int]
    cache: dict[bytes, _Candidates] = field(default_factory=dict)
    crossing_cache: dict[tuple, dict[bytes, torch.Tensor]] = field(default_factory=dict)

    def crossings(self, stops: tuple[str, ...], words: int) -> dict[bytes, torch.Tensor]:
        """Tokens containing a stop string, grouped by the bytes before its first occurrence, each
        group as a packed bitmask row of ``words`` words (cached)."""
        key = (stops, words)
        hit = self.crossing_cache.get(key)
        if hit is None:
            groups: dict[bytes, list[int]] = {}
            needles = [s.encode() for s in stops if s]
            for i, b in enumerate(self.token_bytes):
                cuts = [k for k in (b.find(n) for n in needles) if k >= 0] if b else []
                if cuts:
                    groups.setdefault(b[: min(cuts)], []).append(i)
            hit = {}
            for head, ids in groups.items():
                hit[head] = ids_to_bitmask(ids, words)
            if len(self.crossing_cache) > 16:
                self.crossing_cache.clear()
            self.crossing_cache[key] = hit
        return hit

    def candidates(self, pending: bytes) -> _Candidates:
        hit = self.cache.get(pending)
        if hit is None:
            prefix, ext, rest = [], [], []
            for i, b in enumerate(self.token_bytes):
                if not b:
                    continue
                if pending.startswith(b):
                    prefix.append(i)
                elif b.startswith(pending):
                    ext.append(i)
                    rest.append(b[len(pending):])
            rest_token = torch.tensor([self.by_bytes.get(r, -1) for r in rest], dtype=torch.long)
            hit = _Candidates(torch.tensor(prefix, dtype=torch.long), torch.tensor(ext, dtype=torch.long), rest,
                              rest_token)
            if len(self.cache) > 64:
                self.cache.clear()
            self.cache[pending] = hit
        return hit


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCABS_LOCK = threading.Lock()


def healing_vocab(tokenizer: Any) -> HealingVocab:
    with _VOCABS_LOCK:
        vocab = _VOCABS.get(tokenizer)
        if vocab is None:
            from radixlm.constrained.vocab import token_bytes

            table = token_bytes(tokenizer, len(tokenizer))
            by_bytes: dict[bytes, int] = {}
            for i, b in enumerate(table):
                if b:
                    by_bytes.setdefault(b, i)
            vocab = _VOCABS[tokenizer] = HealingVocab(table, by_bytes)
        return vocab


def plan_healing(input_ids: list[int], params: Any, tokenizer: Any) -> TokenHealing | None:
    """What healing would back off for this prompt, or None (healing off, or nothing to heal)."""
    if not getattr(params, "token_healing", False) or params.max_new_tokens == 0 or len(input_ids) < 2:
        return None
    last = input_ids[-1]
    table = healing_vocab(tokenizer).token_bytes
    data = table[last] if 0 <= last < len(table) else None
    if not data:
        return None  # a control token (BOS, a chat marker): nothing to heal
    try:
        return TokenHealing(last, data, data.decode("utf-8"))
    except UnicodeDecodeError:  # half of a character
        return None


def start_healing(req: Any, tokenizer: Any) -> None:
    """Back off the prompt's last token when the request asks for healing (see the module doc).
    A request with a grammar constraint gets the wrapper once its grammar has compiled
    (``wrap``); one without gets it now."""
    healing = plan_healing(req.input_ids, req.params, tokenizer)
    if healing is None:
        return
    req.input_ids = req.input_ids[:-1]
    req.healing = healing
    if req.params.constraint is None:
        req.grammar = HealingGrammar(None, healing.data, healing_vocab(tokenizer))  # no stops to cross: none


def wrap(req: Any, grammar: Grammar, tokenizer: Any, stop_ids: tuple[int, ...] = ()) -> Grammar:
    """The request's compiled grammar, behind the healing wrapper when the request heals."""
    if not getattr(req.params, "token_healing", False):
        return grammar
    pending = req.healing.data if getattr(req, "healing", None) is not None else b""
    if not pending and not req.params.stop:
        return grammar  # nothing to heal at either end
    return HealingGrammar(grammar, pending, healing_vocab(tokenizer), list(req.params.stop), tuple(stop_ids))


def healed_text(input_ids: list[int], params: Any, tokenizer: Any) -> str:
    """The text the output starts with that the prompt already has (for the detokenizer)."""
    healing = plan_healing(input_ids, params, tokenizer)
    return "" if healing is None else healing.text


def output_tail(req: Any, tokenizer: Any, window: int) -> str:
    """The last ``window`` output tokens as text, without the healed text (for stop strings)."""
    tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
    healing = getattr(req, "healing", None)
    if healing is not None and len(req.output_ids) <= window and tail.startswith(healing.text):
        tail = tail[len(healing.text):]
    return tail


class HealingGrammar(Grammar):
    """The request's grammar (``inner``, None when unconstrained) behind the healing constraints."""

    __slots__ = ("inner", "_pending", "_vocab", "_history", "_stops", "_stop_ids", "_crossed", "_words")

    def __init__(self, inner: Grammar | None, pending: bytes, vocab: HealingVocab, stops: list[str] = (),
                 stop_ids: tuple[int, ...] = ()) -> None:
        self.inner = inner
        self._pending = pending  # backed-off bytes the output has not spelled out yet
        self._vocab = vocab
        self._history: list[tuple[bytes, int]] = []  # per step: pending before, inner steps taken
        self._stops = tuple(stops) if inner is not None else ()
        self._stop_ids = stop_ids  # the inner grammar's end tokens (its mask allows them where it may end)
        self._crossed = False  # a token ran past the grammar's end into a stop string
        self._words = (len(vocab.token_bytes) + 31) // 32  # bitmask width, as fill_mask last saw it

    @property
    def settled(self) -> bool:
        """Nothing left to heal: the inner grammar (or nothing) can take over alone."""
        return not self._pending and not self._stops

    @property
    def error_message(self) -> str | None:
        return getattr(self.inner, "error_message", None)

    # -- masks -----------------------------------------------------------------------------------

    def batch_target(self) -> Grammar | None:
        # backed-off bytes still pending: this row's mask is the healing's own
        return None if self._pending or self.inner is None else self.inner.batch_target()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._words = bitmask.shape[1]
        if not self._pending:
            if self.inner is None:
                bitmask[row].fill_(-1)
                return
            self.inner.fill_mask(bitmask, row)
            if self._stops and not self._crossed and not self.inner.is_terminated():
                self._allow_stop_crossing(bitmask, row)
            return
        words = bitmask.shape[1]
        cand = self._vocab.candidates(self._pending)
        allowed = torch.zeros(words * 32, dtype=torch.bool)
        allowed[cand.prefix_ids] = True
        if self.inner is None:
            allowed[cand.ext_ids] = True
        else:
            self.inner.fill_mask(bitmask, row)
            inner_ok = bitmask_to_bool(bitmask[row : row + 1], words * 32)[0]
            one = cand.ext_rest_token >= 0
            allowed[cand.ext_ids[one]] = inner_ok[cand.ext_rest_token[one]]
            self._check_multi_token_rests(cand, one, inner_ok, allowed)
        bitmask[row] = bool_to_bitmask(allowed, words)

    def _allow_stop_crossing(self, bitmask: torch.Tensor, row: int) -> None:
        """Tokens that run past the grammar's end into a stop string: "24" + " hours" with stop " "
        (the output is cut at the stop, so only "24" counts). Allowed where the grammar accepts the
        part before the stop and may end right after it."""
        words = bitmask.shape[1]
        inner_ok = bitmask_to_bool(bitmask[row : row + 1], words * 32)[0]
        budget = FULL_CHECK_BUDGET
        for head, packed in self._vocab.crossings(self._stops, words).items():
            if head:
                first = self._vocab.by_bytes.get(head[:1], -1)
                if first < 0 or not bool(inner_ok[first]) or budget <= 0:
                    continue
                budget -= 1
                if not self._can_end_after(head):
                    continue
            elif not any(bool(inner_ok[t]) for t in self._stop_ids):
                continue
            bitmask[row] |= packed

    def _can_end_after(self, head: bytes) -> bool:
        steps = self._accept_bytes(head)
        if steps is None:
            return False
        probe = torch.zeros((1, self._words), dtype=torch.int32)
        self.inner.fill_mask(probe, 0)
        ok = bitmask_to_bool(probe, self._words * 32)[0]
        self.inner.rollback(steps)
        return any(bool(ok[t]) for t in self._stop_ids if t < ok.numel())

    def _check_multi_token_rests(self, cand: _Candidates, one: torch.Tensor, inner_ok: torch.Tensor,
                                 allowed: torch.Tensor) -> None:
        """Remainders that are not one token: prune by their first byte's token in the inner mask,
        then check the survivors (up to a budget; the rest stay disallowed, which is safe)."""
        by_bytes, budget = self._vocab.by_bytes, FULL_CHECK_BUDGET
        for k in (~one).nonzero().flatten().tolist():
            rest = cand.ext_rest[k]
            first = by_bytes.get(rest[:1], -1)
            if first < 0 or not bool(inner_ok[first]):
                continue
            if budget <= 0:
                break
            budget -= 1
            steps = self._accept_bytes(rest)
            if steps is not None:
                self.inner.rollback(steps)
                allowed[int(cand.ext_ids[k])] = True

    # -- advancing -------------------------------------------------------------------------------

    def _accept_bytes(self, data: bytes) -> int | None:
        """Advance the inner grammar by ``data`` (one token if it is one, else byte tokens);
        the steps taken, or None (state unchanged) if it refuses."""
        if not data:
            return 0
        token = self._vocab.by_bytes.get(data)
        tokens = [token] if token is not None else [self._vocab.by_bytes.get(data[i:i + 1]) for i in range(len(data))]
        done = 0
        for t in tokens:
            if t is None or not self.inner.accept(t):
                if done:
                    self.inner.rollback(done)
                return None
            done += 1
        return done

    def _consume(self, data: bytes | None) -> bool:
        """Healing step: ``data`` must continue the pending bytes (see fill_mask)."""
        if not data:
            return False
        pending = self._pending
        if pending.startswith(data):
            self._pending = pending[len(data):]
            self._history.append((pending, 0))
            return True
        if not data.startswith(pending):
            return False
        rest, steps = data[len(pending):], 0
        if rest and self.inner is not None:
            steps = self._accept_bytes(rest)
            if steps is None:
                return False
        self._pending = b""
        self._history.append((pending, steps))
        return True

    def _cross(self, data: bytes | None) -> bool:
        """A token past the grammar's end into a stop string (see _allow_stop_crossing)."""
        cut = min((k for k in (data.find(s.encode()) for s in self._stops if s) if k >= 0), default=-1) if data else -1
        if cut < 0:
            return False
        head = data[:cut]
        if head and not self._can_end_after(head):
            return False
        steps = self._accept_bytes(head)
        if steps is None:
            return False
        self._crossed = True
        self._history.append((b"", steps))
        return True

    def accept(self, token_id: int) -> bool:
        table = self._vocab.token_bytes
        data = table[token_id] if 0 <= token_id < len(table) else None
        if self._pending:
            return self._consume(data)
        if self._crossed:
            return False  # the request ends at the stop string
        ok = self.inner.accept(token_id) if self.inner is not None else True
        if ok:
            self._history.append((b"", 1 if self.inner is not None else 0))
            return True
        return bool(self._stops) and self._cross(data)

    def accept_string(self, text: str) -> bool:
        if self._pending:
            return self._consume(text.encode())
        ok = self.inner.accept_string(text) if self.inner is not None else not self._crossed
        if ok:
            self._history.append((b"", 1 if self.inner is not None else 0))
        return ok

    def is_terminated(self) -> bool:
        return not self._pending and self.inner is not None and self.inner.is_terminated()

    def jump_forward(self) -> str | None:
        # the healed bytes are the model's to tokenize; only the inner grammar forces text after
        if self._pending or self._crossed or self.inner is None:
            return None
        return self.inner.jump_forward()

    def rollback(self, k: int) -> None:
        if not 0 <= k <= len(self._history):
            raise ValueError(f"can roll back 0..{len(self._history)} steps, not {k}")
        for _ in range(k):
            pending, steps = self._history.pop()
            if steps and self.inner is not None:
                self.inner.rollback(steps)
            if pending:
                self._pending = pending
            self._crossed = False

    def copy(self) -> HealingGrammar:
        inner = None if self.inner is None else self.inner.copy()
        twin = HealingGrammar(inner, self._pending, self._vocab, self._stops, self._stop_ids)
        twin._history, twin._crossed = list(self._history), self._crossed
        return twin
