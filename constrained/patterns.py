"""User-supplied regular expressions, searched with a time bound and off the shared thread.

Every ``pattern`` / ``patternProperties`` of a JSON schema and every ``stop_regex`` comes from a
client. Python's ``re`` backtracks without a bound and holds the GIL while it does: one pattern
such as ``^(.*?,){11}P`` froze every request for seconds. So user patterns run on the ``regex``
module (re-compatible), which takes a timeout and, with ``concurrent=True``, releases the GIL.

A check runs in two tries. First inline, on the caller's thread, for at most ``INLINE_S`` (an
ordinary pattern over a bounded text takes microseconds, so nearly every check ends here with no
thread hop). If that is not enough, the whole check is handed to a small worker pool with the full
bound ``PATTERN_TIMEOUT_S``; the caller gets a Future and parks its request until the verdict is in,
so the thread every request shares never waits for it. A check that exceeds the full bound raises
:class:`PatternTimeout`, which fails only its own request (a 400 naming the pattern).

jsonschema runs ``re.search`` from three of its modules; :func:`install_jsonschema_hook` points
those at :data:`BOUNDED_RE`, which behaves as ``re`` except that inside :func:`time_bound` the
searches use the ``regex`` module with the bound's remaining time.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import regex

from radixlm.constrained.base import GrammarError

INLINE_S = 0.005  # the budget of a check on the caller's (shared) thread
PATTERN_TIMEOUT_S = 1.0  # the budget of a check on the worker pool
POOL_THREADS = 1  # checks past INLINE_S are rare (and hostile); one core at most goes to them
POOL_NICENESS = 10  # and it mostly yields that core to the forward passes

T = TypeVar("T")
_local = threading.local()


class PatternTimeout(GrammarError):
    """A user pattern that ran past its bound (the request's fault: a 400)."""

    def __init__(self, pattern: str, seconds: float) -> None:
        super().__init__(f"pattern {pattern[:200]!r} took over {seconds:g}s to search; simplify it")
        self.pattern = pattern


@functools.lru_cache(maxsize=4096)
def compile_pattern(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


@contextlib.contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Searches through :func:`search` on this thread share a budget of ``seconds``."""
    outer = getattr(_local, "deadline", None), getattr(_local, "budget", None)
    _local.deadline, _local.budget = time.monotonic() + seconds, seconds
    try:
        yield
    finally:
        _local.deadline, _local.budget = outer


def search(pattern: str, text: str, flags: int = 0) -> regex.Match | None:
    """``re.search`` semantics; bounded by the enclosing :func:`time_bound` (unbounded outside)."""
    deadline = getattr(_local, "deadline", None)
    if deadline is None:
        return re.search(pattern, text, flags)
    left = deadline - time.monotonic()
    if left <= 0:
        raise PatternTimeout(pattern, _local.budget)
    compiled = compile_pattern(pattern) if not flags else regex.compile(pattern, flags)
    try:
        return compiled.search(text, timeout=left, concurrent=True)
    except TimeoutError:
        raise PatternTimeout(pattern, _local.budget) from None


# `re` as jsonschema sees it: the same module, but `search` is the bounded one above
BOUNDED_RE = types.SimpleNamespace(**{name: getattr(re, name) for name in dir(re) if not name.startswith("__")})
BOUNDED_RE.search = search


def install_jsonschema_hook() -> None:
    """Routes jsonschema's pattern searches (``pattern``, ``patternProperties``, and the
    ``additionalProperties`` / ``unevaluatedProperties`` lookups of pattern keys) through
    :func:`search`. Idempotent; RuntimeError if jsonschema's layout changed (a test pins it)."""
    from jsonschema import _keywords, _legacy_keywords, _utils

    for module in (_keywords, _legacy_keywords, _utils):
        if module.re is not re and module.re is not BOUNDED_RE:
            raise RuntimeError(f"{module.__name__}.re is not the re module; the pattern bound cannot be installed")
        module.re = BOUNDED_RE


class PatternPool:
    """Runs checks with the full bound on worker threads (the GIL is released while they search)."""

    def __init__(self, threads: int = POOL_THREADS) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="radixlm-patterns",
                                        initializer=_lower_priority)

    def submit(self, fn: Callable[[], T], seconds: float = PATTERN_TIMEOUT_S) -> Future:
        def bounded() -> T:
            with time_bound(seconds):
                return fn()

        return self._pool.submit(bounded)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    # Linux schedules threads as tasks: a worker's own niceness leaves the scheduler thread's alone
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), POOL_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: the time bound still holds
        pass


_pool: PatternPool | None = None
_pool_lock = threading.Lock()


def pattern_pool() -> PatternPool:
    """The process's pool (created on first use: most processes never need it)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = PatternPool()
        return _pool


def run_bounded(fn: Callable[[], T], inline: bool = True) -> T | Future:
    """``fn()`` inline within INLINE_S, else a Future of ``fn()`` on the pool with the full bound
    (which raises PatternTimeout past it). ``fn`` must be safe to run twice (a pure check). Callers
    pass ``inline=False`` for patterns that already needed the pool once: they would only spend
    the shared thread's INLINE_S again before going there."""
    if inline:
        try:
            with time_bound(INLINE_S):
                return fn()
        except PatternTimeout:
            pass
    return pattern_pool().submit(fn)


def result_of(value: Any) -> Any:
    """The value of a :func:`run_bounded` result, waiting for a Future (PatternTimeout re-raised)."""
    return value.result() if isinstance(value, Future) else value
