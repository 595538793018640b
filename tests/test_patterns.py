"""Client patterns run bounded and off the shared thread (constrained/patterns.py, issue 19 item 2):
jsonschema's every pattern lookup goes through the bound, bounded searches agree with `re`, a slow
check runs on the pool while the caller's thread goes on, and where a check ran never changes an
answer (the scheduler parks the request until the verdict is in)."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.constrained import patterns
from radixlm.constrained.end_check import SchemaCheck
from radixlm.constrained.patterns import PatternTimeout, pattern_pool, run_bounded, search, time_bound

FROZEN = r"^(.*?,){11}P"
COMMAS = "1," * 30


def test_every_jsonschema_pattern_lookup_is_bounded():
    from jsonschema import _keywords, _legacy_keywords, _utils

    assert _keywords.re is _utils.re is _legacy_keywords.re is patterns.BOUNDED_RE
    slow_key = {COMMAS: 1}
    cases = [
        ({"type": "string", "pattern": FROZEN}, COMMAS),
        ({"not": {"pattern": FROZEN}}, COMMAS),
        ({"patternProperties": {FROZEN: {"type": "string"}}}, slow_key),
        ({"patternProperties": {FROZEN: {}}, "additionalProperties": False}, slow_key),
        ({"patternProperties": {FROZEN: {}}, "unevaluatedProperties": False}, slow_key),
        ({"propertyNames": {"pattern": FROZEN}}, slow_key),
        ({"$schema": "http://json-schema.org/draft-04/schema#", "patternProperties": {FROZEN: {}},
          "additionalProperties": False}, slow_key),
    ]
    for schema, value in cases:
        check = SchemaCheck(schema)
        start = time.monotonic()
        with pytest.raises(PatternTimeout, match="took over"), time_bound(0.05):
            check.violation(json.dumps(value).encode())
        assert time.monotonic() - start < 5, schema  # bounded, not the minutes `re` would take


_PIECES = ["a", "b", ".", "a*", "b+", "(a|b)", "[ab]", "a?", "\\d", "(?:ab)*", "^", "$", "a{2}", "[^a]"]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=6), st.text(alphabet="ab1 ", max_size=20))
def test_bounded_search_agrees_with_re(pieces, text):
    pattern = "".join(pieces)
    expected = re.search(pattern, text)
    with time_bound(5.0):
        got = search(pattern, text)
    assert (got is None) == (expected is None)
    if got is not None:
        assert got.span() == expected.span()


def test_quick_checks_run_inline_and_slow_ones_on_the_pool_without_blocking_the_caller():
    assert run_bounded(lambda: search("a+", "caab").span()) == (1, 3)
    future = run_bounded(lambda: search(FROZEN, COMMAS))
    assert isinstance(future, Future)
    ticks = 0
    while not future.done():  # the caller's thread goes on while the pool searches
        ticks += 1
        time.sleep(0.001)
    assert ticks > 10
    with pytest.raises(PatternTimeout):
        future.result()


def test_pool_search_releases_the_gil():
    future = pattern_pool().submit(lambda: search(FROZEN, COMMAS), seconds=0.5)
    counted = 0
    stop = threading.Event()

    def count():
        nonlocal counted
        while not stop.is_set():
            counted += 1

    counter = threading.Thread(target=count)
    counter.start()
    with pytest.raises(PatternTimeout):
        future.result()
    stop.set()
    counter.join()
    assert counted > 10_000  # pure-Python work went on during the search


def test_a_bound_is_per_thread():
    with time_bound(0.01):
        errors = []
        other = threading.Thread(target=lambda: errors.append(search("a", "a") is None))
        other.start()
        other.join()
    assert errors == [False]


# --------------------------------------------------------------------------- answers never change
@pytest.mark.slow
@pytest.mark.parametrize("params", [
    {"stop_regex": [r"\d{2}", r"(?:w|x)yz"], "max_new_tokens": 40},
    {"json_schema": json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "not": {"properties": {"name": {"pattern": "^X"}}}}), "max_new_tokens": 40},
])
def test_where_a_check_runs_never_changes_the_answer(engine, monkeypatch, params):
    prompts = ["Give a person as JSON:", "Count: 1, 2, 3,", "The year was"]
    sp = {**params, "temperature": 0}
    inline = [engine.generate(p, sp) for p in prompts]
    monkeypatch.setattr(patterns, "INLINE_S", 0.0)  # every check on the pool, the request parked
    pooled = [engine.generate(p, sp) for p in prompts]
    for a, b in zip(inline, pooled):
        assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
