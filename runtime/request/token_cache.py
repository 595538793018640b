"""Tokenizing a text that extends one tokenized recently, past a safe split only.

Programs resend a state's whole text on every call and chat clients resend the whole history, so
most prompts extend (or share a long prefix with) a text tokenized a moment ago. Tokenizing it again
costs a microsecond or two a token: ~50-100 ms for a 50,000-token agent history, before its first
token, however little it added. `PrefixTokenizer` keeps recent texts with their ids and tokenizes only
what follows a split it can prove safe:

- It applies to tokenizers whose pre-tokenizer cuts the text into pieces the model's BPE never merges
  across (a regex split: GPT-2's ByteLevel, Llama 3's and Qwen's Split) with no normalizer, and whose
  encodings report contiguous character offsets; for any other tokenizer (one whose merges cross
  spaces, a normalizer that moves characters) every text is tokenized whole.
- A piece's extent depends only on the text from its start to a few characters past its end (the
  regex's alternatives and lookaheads reach at most a handful of characters). So a piece boundary of
  the cached text at least `MARGIN` characters before the point where the two texts part is a piece
  boundary of the new text too, and the new text's ids are the cached ids before it followed by the
  ids of the new text from it on, tokenized on their own (added tokens are pieces of their own, and a
  boundary never falls inside one).

tests/test_token_cache.py checks the ids against whole-text tokenization with hypothesis, for the
built-in tokenizer and for a byte-level BPE whose merges cross spaces (which is tokenized whole).
Memory is bounded (entries and characters), least recently used first out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

MARGIN = 64  # characters between the split and the point where the texts part
WINDOW = 4096  # tokens at an entry's end whose offsets are kept: a split further back tokenizes more
MIN_CHARS = 2048  # shorter texts are tokenized whole (the saving would be smaller than the bookkeeping)
HEAD = 64  # entries are found by their first HEAD characters
PROBES = 4  # entries a text that extends none is measured against (texts sharing a head share a prefix)


@dataclass(slots=True, eq=False)  # compared by identity: field equality would compare whole texts
class _Entry:
    text: str
    ids: list[int]  # without the tokenizer's added special tokens (BOS, ...)
    first: int  # the token the offsets begin at: the last WINDOW tokens are kept (O(1) per call)
    # (starts: int64, each kept token's first character; piece: bool, the kept token starts a piece of the
    # pre-tokenizer), or what makes them: an extended text's are made only once a text is planned from
    # it (a batch of prompts sharing a head extends one entry many times; most are never extended)
    arrays: tuple[np.ndarray, np.ndarray] | Callable[[], tuple[np.ndarray, np.ndarray]]

    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        if callable(self.arrays):
            self.arrays = self.arrays()  # (two threads may both make them: the same arrays)
        return self.arrays

    def trimmed(self) -> _Entry:
        starts, piece = self.offsets()
        cut = max(0, len(starts) - WINDOW)
        if cut:
            self.first, self.arrays = self.first + cut, (starts[cut:], piece[cut:])
        return self


class PrefixTokenizer:
    """`encode(text)` gives `tokenizer(text).input_ids`, re-using a recent text's ids where the text
    extends it (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer: Any, max_entries: int = 64, max_chars: int = 32 * 2**20):
        self.tokenizer = tokenizer
        self.max_entries, self.max_chars = max_entries, max_chars
        self._backend = _eligible(tokenizer)
        self._prefix: list[int] = []
        self._suffix: list[int] = []
        if self._backend is not None:
            self._prefix, self._suffix = _framing(tokenizer)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id(entry), least recently used first
        self._by_head: dict[str, list[_Entry]] = {}
        self._chars = 0
        self._lock = threading.Lock()
        self.reused_tokens = 0  # figures: tokens taken from entries, tokens tokenized anew
        self.new_tokens = 0

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def clear(self) -> None:
        """Forgets every text (a flush of the caches: the next call tokenizes as a cold one would)."""
        with self._lock:
            self._entries.clear()
            self._by_head.clear()
            self._chars = 0

    def encode(self, text: str) -> list[int]:
        if self._backend is None or len(text) < MIN_CHARS:
            return self.tokenizer(text).input_ids
        plan = self._plan(text)
        if plan is None:
            return self._whole([text])[0]
        entry, k, at = plan
        if at == len(text):
            return self._reuse(entry)
        return self._extend(text, entry, k, self._backend.encode(text[at:], add_special_tokens=False), at)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]` in two batch calls (on every core the tokenizer may use): the
        texts no entry serves, of those sharing a head only the first; then every other text's tail,
        past its split from the entry that serves it."""
        if self._backend is None:
            return self.tokenizer(list(texts)).input_ids if texts else []
        out: list[list[int] | None] = [None] * len(texts)
        whole, later, heads = [], [], set()
        for i, text in enumerate(texts):
            if len(text) < MIN_CHARS:
                whole.append(i)
            elif text[:HEAD] in heads:
                later.append(i)  # shares a head with a text before it in this batch: it may extend that one
            elif self._plan(text) is not None:
                later.append(i)
            else:
                heads.add(text[:HEAD])
                whole.append(i)
        for i, ids in zip(whole, self._whole([texts[i] for i in whole])):
            out[i] = ids
        plans = [(i, self._plan(texts[i])) for i in later]
        alone = [i for i, plan in plans if plan is None]
        for i, ids in zip(alone, self._whole([texts[i] for i in alone])):
            out[i] = ids
        served = []
        for i, plan in plans:
            if plan is None:
                continue
            if plan[2] == len(texts[i]):  # seen whole
                out[i] = self._reuse(plan[0])
            else:
                served.append((i, plan))
        tails = self._backend.encode_batch([texts[i][at:] for i, (_, _, at) in served],
                                           add_special_tokens=False) if served else []
        for (i, (entry, k, at)), enc in zip(served, tails):
            out[i] = self._extend(texts[i], entry, k, enc, at)
        return out

    def _plan(self, text: str) -> tuple[_Entry, int, int] | None:
        """(entry, tokens kept, character where tokenizing resumes) for a text an entry serves; for a
        text an entry holds whole (a prompt sent again), all its tokens and the text's end."""
        entry, common = self._closest(text)
        if entry is not None and common == len(text) == len(entry.text):
            return entry, len(entry.ids), common
        split = None if entry is None else _split(entry, common)
        return None if split is None else (entry, *split)

    def _whole(self, texts: list[str]) -> list[list[int]]:
        """Texts tokenized whole in one call; the long ones kept as entries."""
        if not texts:
            return []
        encs = self._backend.encode_batch(texts, add_special_tokens=False) if len(texts) > 1 else \
            [self._backend.encode(texts[0], add_special_tokens=False)]
        out = []
        for text, enc in zip(texts, encs):
            if len(text) >= MIN_CHARS:
                made = _entry(text, enc)
                self.new_tokens += len(made.ids)
                self._store(made.trimmed())
            out.append(self._framed(enc.ids))
        return out

    def _extend(self, text: str, entry: _Entry, k: int, tail: Any, at: int) -> list[int]:
        """`text`'s ids: the entry's first k, then those of `tail` (the encoding of text[at:])."""
        ids = entry.ids[:k] + tail.ids
        first = max(entry.first, len(ids) - WINDOW)  # the kept window, as `trimmed` would cut it
        starts, piece = entry.offsets()  # (made when the text was planned from it)
        local = k - entry.first  # the entry's arrays hold tokens from entry.first on

        def arrays() -> tuple[np.ndarray, np.ndarray]:
            tail_starts, tail_piece = _offsets(tail, at)
            cut = first - entry.first
            return (np.concatenate([starts[:local], tail_starts])[cut:],
                    np.concatenate([piece[:local], tail_piece])[cut:])

        made = _Entry(text, ids, first, arrays)
        self.reused_tokens += k
        self.new_tokens += len(tail.ids)
        self._store(made)
        return self._framed(made.ids)

    def _reuse(self, entry: _Entry) -> list[int]:
        """The ids of a text seen whole; its entry becomes the most recently used."""
        with self._lock:
            if id(entry) in self._entries:
                self._entries.move_to_end(id(entry))
                bucket = self._by_head[entry.text[:HEAD]]
                bucket.remove(entry)
                bucket.insert(0, entry)
        self.reused_tokens += len(entry.ids)
        return self._framed(entry.ids)

    def _framed(self, ids: list[int]) -> list[int]:
        return [*self._prefix, *ids, *self._suffix] if self._prefix or self._suffix else list(ids)

    def _closest(self, text: str) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `text` (among those it extends whole, else among the
        PROBES most recent), and that prefix's length in characters."""
        with self._lock:
            candidates = list(self._by_head.get(text[:HEAD], ()))
        for entry in candidates:  # newest first; a failed startswith stops at the first difference
            if text.startswith(entry.text):
                return entry, len(entry.text)
        best, best_len = None, 0
        for entry in candidates[:PROBES]:
            common = _common_prefix(text, entry.text)
            if common > best_len:
                best, best_len = entry, common
        return best, best_len

    def _store(self, entry: _Entry) -> None:
        with self._lock:
            head = entry.text[:HEAD]
            for old in [e for e in self._by_head.get(head, ()) if entry.text.startswith(e.text)]:
                self._drop(old)  # extended: the new entry serves whatever the old one did
            self._by_head.setdefault(head, []).insert(0, entry)
            self._entries[id(entry)] = entry
            self._chars += len(entry.text)
            while self._entries and (len(self._entries) > self.max_entries or self._chars > self.max_chars):
                self._drop(next(iter(self._entries.values())))

    def _drop(self, entry: _Entry) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self._chars -= len(entry.text)
        bucket = self._by_head.get(entry.text[:HEAD], [])
        if entry in bucket:
            bucket.remove(entry)
        if not bucket:
            self._by_head.pop(entry.text[:HEAD], None)


def _entry(text: str, enc: Any) -> _Entry:
    """An entry for a text tokenized whole, from its encoding."""
    return _Entry(text, enc.ids, 0, _offsets(enc, 0))


def _offsets(enc: Any, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, piece) of an encoding's tokens, its character offsets shifted by `offset`."""
    starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(enc.ids)) + offset
    words = np.fromiter((-1 if w is None else w for w in enc.word_ids), dtype=np.int64, count=len(enc.ids))
    piece = np.ones(len(words), dtype=bool)
    piece[1:] = words[1:] != words[:-1]
    return starts, piece


def _split(entry: _Entry, common: int) -> tuple[int, int] | None:
    """(tokens kept, character where tokenizing resumes): the last piece start of `entry` at least
    MARGIN characters before `common`, among the tokens whose offsets it keeps; None when there is
    none worth keeping (a text that parts further back is tokenized whole)."""
    limit = common - MARGIN
    if limit <= 0:
        return None
    starts, piece = entry.offsets()
    local = int(np.searchsorted(starts, limit, side="right"))  # kept tokens starting at or before limit
    found = np.flatnonzero(piece[:local])
    if not len(found):
        return None
    k = int(found[-1])  # the last piece start at or before limit
    return (entry.first + k, int(starts[k])) if entry.first + k > 0 else None


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over slices: a few copies, not a loop)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _eligible(tokenizer: Any) -> Any:
    """The fast tokenizer's backend when its splits are provably local (module docstring), else None."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:  # the parts' own JSON: the whole tokenizer's (vocabulary and merges) takes 0.1-1 s to parse
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
        normalizer, model = backend.normalizer, type(backend.model).__name__
    except Exception:
        return None
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits = any(s.get("type") == "Split" or (s.get("type") == "ByteLevel" and s.get("use_regex", True))
                 for s in steps)
    if any(s.get("add_prefix_space") or s.get("prepend_scheme") not in (None, "never") for s in steps):
        return None  # a space added before the text: a tail tokenized on its own would get one too
    if normalizer is not None or not splits or model != "BPE":
        return None
    probe = "Hello world,  it's   me!\n\nAnd 12345 numbers, é ü 😀" * 3
    enc = backend.encode(probe, add_special_tokens=False)
    # a piece's first token starts where the text before it ends (tokens inside a piece may share a
    # multi-byte character's offsets); offsets that skip or trim characters cannot locate a split
    starts, ends, words = [s for s, _ in enc.offsets], [e for _, e in enc.offsets], enc.word_ids
    firsts = [i for i in range(1, len(starts)) if words[i] != words[i - 1]]
    if starts[0] != 0 or ends[-1] != len(probe) or any(starts[i] != max(ends[:i]) for i in firsts):
        return None
    if tokenizer(probe).input_ids != [*_framing(tokenizer)[0], *enc.ids, *_framing(tokenizer)[1]]:
        return None
    return backend


def _framing(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids `tokenizer(text)` adds before and after the text's own (BOS, EOS, ...)."""
    plain = tokenizer("a", add_special_tokens=False).input_ids
    framed = tokenizer("a").input_ids
    at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i:i + len(plain)] == plain), 0)
    return framed[:at], framed[at + len(plain):]
