"""The grammar interface shared by every backend, plus the compile cache and the bitmask helpers.

A backend turns ``(kind, spec)`` into a compiled form once (cached in a bounded LRU keyed by
``(kind, spec)``) and hands out a fresh :class:`Grammar` (a matcher with its own state) per call.
Compiles run on a small thread pool, so a slow spec never blocks the decode loop: the scheduler
calls :meth:`GrammarBackend.compile_async` and polls the future.

Token masks are packed bitmasks: int32 ``[batch, ceil(vocab_size / 32)]``, bit ``j % 32`` of word
``j // 32`` set when token ``j`` is allowed (the layout xgrammar and outlines-core both write).
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # the bitmasks' helpers (bitmask.py) import torch where they run: the HTTP process checks
    import torch  # specs with these types and never imports it


# ``json_schema`` spec meaning "any JSON object" (response_format {"type": "json_object"}).
ANY_JSON_OBJECT = "$$ANY$$"
# Specs longer than this compile on a lane of their own, so slow compiles never queue ahead of
# small ones (a schema of megabytes compiles for most of a minute and would starve everyone).
LARGE_SPEC_CHARS = 8 * 1024
DEFAULT_CACHE_BYTES = 512 * 2**20  # compiled grammars kept, by their reported memory size


class GrammarError(ValueError):
    """A spec that cannot be compiled; the message starts with ``invalid <kind>:``."""


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    capacity: int
    bytes: int = 0  # memory of the cached compiled grammars
    abandoned: int = 0  # compiles dropped because every request waiting for them left


class Grammar(ABC):
    """One request's matcher state over a compiled grammar.

    End of output: the backend's stop tokens (the tokenizer's EOS plus any extra stop ids) are
    allowed exactly where the grammar may end, and accepting one terminates the grammar. Special
    (control) tokens other than the stop tokens are never allowed.
    """

    @abstractmethod
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the current state into ``bitmask[row]`` (a CPU int32
        tensor from :meth:`GrammarBackend.allocate_bitmask`). After termination only the stop
        tokens are allowed, so a stray extra step samples EOS instead of crashing."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the token is not allowed here."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted at an accepting state."""

    @abstractmethod
    def jump_forward(self) -> str | None:
        """The continuation every valid output must take next (>= 1 char), or None."""

    @abstractmethod
    def accept_string(self, text: str) -> bool:
        """Advance by ``text`` (e.g. a jump-forward string); False (state unchanged) if not
        allowed. Counts as one step for :meth:`rollback`."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted steps (tokens or strings); ValueError past the history."""

    @abstractmethod
    def copy(self) -> Grammar:
        """An independent matcher in the same state (for n > 1 and fork)."""

    def batch_target(self) -> Grammar | None:
        """The grammar whose next mask the backend's `fill_rows` can compute with other rows' at once
        (this one, or the one a wrapper delegates its mask to), or None: fill this row on its own."""
        return None


class _CheckedSchema(NamedTuple):
    compiled: Any  # the backend's compiled grammar (maybe of a relaxed schema)
    check: Any  # end_check.SchemaCheck of the original schema


def _memory_of(compiled: Any, spec: str) -> int:
    """A compiled grammar's memory: what the backend reports (xgrammar does), else an estimate."""
    inner = compiled.compiled if isinstance(compiled, _CheckedSchema) else compiled
    return int(getattr(inner, "memory_size_bytes", 0) or 64 * len(spec))


class GrammarBackend(ABC):
    """Compiles specs to grammars. Subclasses set ``name`` and ``kinds`` and implement
    :meth:`_compile` (spec -> compiled form, raising GrammarError) and :meth:`_new_grammar`."""

    name: str = ""
    kinds: frozenset[str] = frozenset()

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        cache_size: int = 256,
        num_threads: int = 2,
        stop_token_ids: Iterable[int] = (),
        max_rollback_tokens: int = 256,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if cache_size < 1 or num_threads < 1 or max_rollback_tokens < 0:
            raise ValueError("cache_size and num_threads must be >= 1, max_rollback_tokens >= 0")
        self.vocab_size = vocab_size
        self.max_rollback_tokens = max_rollback_tokens
        self.tokenizer = tokenizer
        self._token_bytes: list[bytes | None] | None = None
        eos = getattr(tokenizer, "eos_token_id", None)
        stops = ([eos] if eos is not None else []) + [int(t) for t in stop_token_ids]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(t for t in stops if 0 <= t < vocab_size))
        if not self.stop_token_ids:
            raise ValueError("the tokenizer has no eos_token_id and no stop_token_ids were given")
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = 0
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix=f"grammar-{self.name}")
        self._large_pool = ThreadPoolExecutor(1, thread_name_prefix=f"grammar-{self.name}-large")
        self._waiters: dict[tuple[str, str], int] = {}  # requests waiting for a compile in progress
        self._sizes: dict[tuple[str, str], int] = {}
        self._cache_bytes = cache_bytes
        self._abandoned = 0

    # -- compiling -------------------------------------------------------------------------------

    def compile(self, kind: str, spec: str, timeout: float | None = None) -> Grammar:
        """Blocking :meth:`compile_async`; raises GrammarError for a bad spec and
        concurrent.futures.TimeoutError past ``timeout`` seconds (the compile goes on, and its
        result is cached)."""
        return self.compile_async(kind, spec).result(timeout)

    def compile_async(self, kind: str, spec: str) -> Future[Grammar]:
        """A future of a fresh Grammar. The compiled form is cached by (kind, spec); concurrent
        requests for one spec share one compile. Errors (GrammarError, also for an unsupported
        kind) arrive through the future, never raised here."""
        out: Future[Grammar] = Future()
        if kind not in self.kinds:
            out.set_exception(
                GrammarError(f"grammar backend {self.name!r} does not support {kind!r}; "
                             f"supported: {', '.join(sorted(self.kinds))}")
            )
            return out
        if not isinstance(spec, str):
            out.set_exception(GrammarError(f"invalid {kind}: the spec must be a string"))
            return out
        key = (kind, spec)
        fresh = False
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
            else:
                pool = self._large_pool if len(spec) > LARGE_SPEC_CHARS else self._pool
                try:
                    compiled = pool.submit(self._compile_checked, kind, spec)
                except RuntimeError:  # the pool is shut down
                    out.set_exception(RuntimeError(f"grammar backend {self.name!r} is shut down"))
                    return out
                self._misses += 1
                self._cache[key] = compiled
                fresh = True
                while len(self._cache) > self._cache_size:
                    self._drop(next(iter(self._cache)))
            if not compiled.done():
                self._waiters[key] = self._waiters.get(key, 0) + 1
        # Callbacks are added outside the lock: on a compile that already finished they run
        # right here, and _account takes the lock (a fast compile deadlocked the caller).
        if fresh:
            compiled.add_done_callback(lambda f: self._account(key, f))
        compiled.add_done_callback(lambda f: self._resolve(key, f, out))
        return out

    def abandon(self, kind: str, spec: str) -> None:
        """A request stopped waiting for its compile (aborted, timed out): when no other request
        waits for it, a queued compile is cancelled and a running one dropped from the cache (its
        result is discarded; a thread cannot be interrupted)."""
        key = (kind, spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is None or compiled.done():
                return
            left = self._waiters.get(key, 0) - 1
            if left > 0:
                self._waiters[key] = left
                return
            self._waiters.pop(key, None)
            self._drop(key)
            self._abandoned += 1
        compiled.cancel()  # outside the lock: a cancelled future runs its callbacks, which take it

    def _drop(self, key: tuple[str, str]) -> None:
        """Removes a cache entry and its memory (under the lock)."""
        self._cache.pop(key, None)
        self._sizes.pop(key, None)

    def _account(self, key: tuple[str, str], compiled: Future) -> None:
        """Counts a finished compile's memory against the budget, evicting the least recently used."""
        failed = compiled.cancelled() or compiled.exception() is not None
        size = 0 if failed else _memory_of(compiled.result(), key[1])
        with self._lock:
            if self._cache.get(key) is compiled:
                self._waiters.pop(key, None)
            if failed or self._cache.get(key) is not compiled:  # abandoned or evicted meanwhile
                return
            self._sizes[key] = size
            for old in list(self._cache):
                if sum(self._sizes.values()) <= self._cache_bytes or old == key:
                    break
                self._drop(old)

    def _compile_checked(self, kind: str, spec: str) -> Any:
        if kind in ("json_schema", "structural_tag") and spec != ANY_JSON_OBJECT:
            from radixlm.constrained.schema_refs import check_schema_refs, check_structural_tag_refs

            (check_schema_refs if kind == "json_schema" else check_structural_tag_refs)(spec)
        try:
            if kind == "json_schema" and spec != ANY_JSON_OBJECT:
                return self._compile_checked_schema(spec)
            return self._compile(kind, spec)
        except GrammarError:
            raise
        except Exception as e:  # a backend failure on a spec is the spec's problem, never a crash
            raise GrammarError(f"invalid {kind}: {self._clean_message(str(e))}") from e

    def _compile_checked_schema(self, spec: str) -> _CheckedSchema:
        """The backend's grammar plus the end check (see end_check.py): every json_schema is
        enforced in full, whatever keywords the backend's grammar leaves out."""
        from radixlm.constrained.end_check import SchemaCheck
        from radixlm.constrained.json_schema import parse_schema, without_unreachable_bounds

        schema = parse_schema(spec)
        reachable = without_unreachable_bounds(schema)
        compiled, dropped = self._compile_json_schema(reachable, spec if reachable == schema else json.dumps(reachable))
        self.token_bytes()  # built here, on the compile thread, not on the decode loop
        return _CheckedSchema(compiled, SchemaCheck(schema, dropped))

    def _compile_json_schema(self, schema: Any, spec: str) -> tuple[Any, frozenset[str]]:
        """Compile a (valid) schema: the compiled form and the keywords the grammar was relaxed
        of. Default: the backend's own compile of the spec as is."""
        return self._compile("json_schema", spec), frozenset()

    def token_bytes(self) -> list[bytes | None]:
        """The bytes of every token (None for control tokens), built once."""
        if self._token_bytes is None:
            from radixlm.constrained.vocab import token_bytes

            self._token_bytes = token_bytes(self.tokenizer, self.vocab_size)
        return self._token_bytes

    def _resolve(self, key: tuple[str, str], compiled: Future, out: Future) -> None:
        if compiled.cancelled():  # the backend was shut down
            out.cancel()
            return
        error = compiled.exception()
        if error is None:
            try:
                out.set_result(self._make_grammar(compiled.result()))
            except Exception as e:
                out.set_exception(e)
            return
        if not isinstance(error, GrammarError):  # unexpected: do not keep it cached
            with self._lock:
                if self._cache.get(key) is compiled:
                    self._drop(key)
        # a fresh exception object per caller: tracebacks are mutated when raised
        out.set_exception(type(error)(*error.args) if isinstance(error, GrammarError) else error)

    def _make_grammar(self, compiled: Any) -> Grammar:
        if not isinstance(compiled, _CheckedSchema):
            return self._new_grammar(compiled)
        from radixlm.constrained.end_check import EndCheckedGrammar

        inner = self._new_grammar(compiled.compiled)
        return EndCheckedGrammar(inner, compiled.check, self.token_bytes(), self.stop_token_ids)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self._cache_size, sum(self._sizes.values()),
                             self._abandoned)

    def shutdown(self) -> None:
        """Stop the compile threads (pending compiles are cancelled) and drop the cache."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._large_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._cache.clear()
            self._sizes.clear()

    @staticmethod
    def _clean_message(message: str) -> str:
        return message.strip()

    @abstractmethod
    def _compile(self, kind: str, spec: str) -> Any:
        """Compile one spec (``json_schema`` may be ANY_JSON_OBJECT); raise GrammarError or any
        exception whose message describes the problem."""

    @abstractmethod
    def _new_grammar(self, compiled: Any) -> Grammar: ...

    # -- masks -----------------------------------------------------------------------------------

    def fill_rows(self, targets: list[tuple[Grammar, int]], bitmask: torch.Tensor) -> None:
        """Computes the masks of several rows at once (`batch_target`s and their rows), in parallel
        where the backend can; each grammar's own `fill_mask`, called next for the same row of the same
        bitmask, then finishes its row without computing it again (called for every bitmask, so that
        what a call computed counts for that bitmask only). Default: nothing at once."""
        return None

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """int32 [batch_size, ceil(vocab_size / 32)] on CPU, every token allowed."""
        from radixlm.constrained import bitmask

        return bitmask.allocate_bitmask(batch_size, self.vocab_size)

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """See bitmask.py's :func:`apply_bitmask`."""
        from radixlm.constrained.bitmask import apply_bitmask

        apply_bitmask(logits, bitmask, rows)

    @staticmethod
    def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """See bitmask.py's :func:`bitmask_to_bool`."""
        from radixlm.constrained.bitmask import bitmask_to_bool

        return bitmask_to_bool(bitmask, vocab_size)


def pop_history(history: Any, k: int) -> list:
    """Remove and return the last ``k`` entries of a grammar's step history, newest first
    (ValueError past the history: rollback's contract)."""
    if not 0 <= k <= len(history):
        raise ValueError(f"can roll back 0..{len(history)} steps, not {k}")
    return [history.pop() for _ in range(k)]


def utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is complete UTF-8 (a forced run may stop mid-char)."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode()
        except UnicodeDecodeError:
            continue
    return ""
