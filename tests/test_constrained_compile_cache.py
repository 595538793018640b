"""radixlm.constrained's compile cache and thread pool on the built-in SmolLM2 tokenizer: a cache hit is a
fresh grammar, compiles run concurrently and never block cache hits, a compile done before submit returns."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import test_constrained
from test_constrained import NAMES, V

from radixlm.constrained import Grammar, GrammarError, create_grammar_backend

# test_constrained.py's module-scoped fixtures, shared by name (imported as such, ruff reads them as unused)
tok = test_constrained.tok


@pytest.mark.parametrize("name", NAMES)
def test_cache_hit_returns_a_fresh_grammar(tok, name):
    backend = create_grammar_backend(name, tok, V, cache_size=2)
    a, b = backend.compile("regex", "[0-9]+x"), backend.compile("regex", "[0-9]+x")
    assert backend.cache_info()[:3] == (1, 1, 1)
    assert a.accept(tok.convert_tokens_to_ids("7")) and not b.accept(tok.convert_tokens_to_ids("x"))
    assert b.accept(tok.convert_tokens_to_ids("3"))
    for rx in ("a", "b", "c"):
        backend.compile("regex", rx)
    assert backend.cache_info().size == 2  # bounded LRU
    backend.shutdown()


def test_compile_async_runs_concurrently_and_never_blocks_cache_hits(tok):
    backend = create_grammar_backend("xgrammar", tok, V, num_threads=2)
    barrier, release, original = threading.Barrier(2, timeout=20), threading.Event(), backend._compile

    def instrumented(kind, spec):
        if spec.startswith("pair"):
            barrier.wait()  # both compiles must be running at once to get past this
        if spec.startswith("slow"):
            release.wait(20)
        return original(kind, spec)

    backend._compile = instrumented
    f1, f2 = backend.compile_async("regex", "pair1"), backend.compile_async("regex", "pair2")
    assert isinstance(f1.result(30), Grammar) and isinstance(f2.result(30), Grammar)
    backend.compile("regex", "[0-9]+")
    slow = [backend.compile_async("regex", f"slow{i}") for i in range(2)]  # both threads busy
    start = time.monotonic()
    assert isinstance(backend.compile("regex", "[0-9]+", timeout=5), Grammar)  # cache hit: no thread
    assert time.monotonic() - start < 2 and not any(f.done() for f in slow)
    same = backend.compile_async("regex", "slow0")  # joins the in-flight compile
    release.set()
    assert all(isinstance(f.result(30), Grammar) for f in [*slow, same])
    assert backend.cache_info().misses == 5
    backend.shutdown()


class _DoneAtSubmit:
    """An executor whose futures are finished before submit returns: the fastest possible compile."""

    def submit(self, fn, *args):
        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future

    def shutdown(self, **kwargs):
        pass


@pytest.mark.parametrize("name", NAMES)
def test_compile_that_finishes_before_submit_returns(tok, name):
    """A compile done before its callbacks are registered once deadlocked compile_async."""
    backend = create_grammar_backend(name, tok, V, cache_size=4)
    backend._pool = backend._large_pool = _DoneAtSubmit()
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(
        [backend.compile("regex", "[0-9]+"), backend.compile("regex", "[0-9]+"),
         backend.compile_async("regex", "[a-z").exception()]), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "compile_async deadlocked on an already finished compile"
    assert isinstance(results[0], Grammar) and isinstance(results[1], Grammar)
    assert isinstance(results[2], GrammarError)
    info = backend.cache_info()
    assert (info.hits, info.misses) == (1, 2) and info.bytes > 0  # accounted, not only cached
    backend.shutdown()
