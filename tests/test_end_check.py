"""The end check's JSON lexer (constrained/end_check.py): it must never hide a complete document from
the check, and it must keep the check from re-parsing the document at every value end inside it."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.constrained.base import Grammar
from radixlm.constrained.end_check import EndCheckedGrammar, SchemaCheck, can_end, lex_after


class AnyBytes(Grammar):
    """A backend grammar that takes every token: the end check alone is under test."""

    def fill_mask(self, bitmask, row) -> None:
        pass

    def accept(self, token_id: int) -> bool:
        return True

    def accept_string(self, text: str) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False

    def jump_forward(self) -> str | None:
        return None

    def rollback(self, k: int) -> None:
        pass

    def copy(self) -> AnyBytes:
        return AnyBytes()


# text that stresses the lexer: quotes, backslashes and brackets inside strings, and non-ASCII
TEXT = st.text(st.sampled_from(list('ab{}[]"\\:,/ é\n\t\u2028')), max_size=8)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
LAYOUT = st.sampled_from([{}, {"indent": 2}, {"separators": (",", ":")}, {"ensure_ascii": False}])


def complete(prefix: bytes) -> bool:
    try:
        json.loads(prefix)
    except ValueError:
        return False
    return True


@settings(max_examples=examples(300), deadline=None)
@given(value=VALUES, layout=LAYOUT, cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_the_lexer_never_hides_a_complete_document_and_reads_any_split_alike(value, layout, cuts):
    doc = json.dumps(value, **layout).encode()
    bounds = sorted({0, len(doc), *(c % (len(doc) + 1) for c in cuts)})
    state = 0
    for a, b in zip(bounds, bounds[1:]):  # token by token, as the grammar accepts them
        state = lex_after(state, doc[a:b])
        assert state == lex_after(0, doc[:b])
    assert state == 0  # a whole document: depth 0, outside any string
    for i in range(1, len(doc) + 1):
        if complete(doc[:i]):
            assert can_end(lex_after(0, doc[:i])), doc[:i]
    if isinstance(value, (list, dict)):  # a container can end only at its last bracket
        ends = [i for i in range(1, len(doc) + 1) if can_end(lex_after(0, doc[:i]))]
        assert ends == [len(doc)]


SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                     "age": {"type": "integer", "maximum": 150}}}}


def checked(doc: bytes, width: int = 3) -> tuple[EndCheckedGrammar, list[int]]:
    tokens = [doc[i:i + width] for i in range(0, len(doc), width)]
    g = EndCheckedGrammar(AnyBytes(), SchemaCheck(SCHEMA), tokens, (len(tokens),))
    return g, list(range(len(tokens)))


def test_a_long_document_is_judged_once_when_it_completes(monkeypatch):
    judged = []
    real = SchemaCheck.violation
    monkeypatch.setattr(SchemaCheck, "violation", lambda self, d: judged.append(d) or real(self, d))
    people = [{"name": f'p{i} "x" [y] \\', "age": 20 + i} for i in range(40)]
    doc = json.dumps(people).encode()
    g, ids = checked(doc)
    for t in ids:
        assert g.accept(t)
    assert judged == [doc]  # once, at the closing bracket, not at each quote and digit before it
    assert g.pending_check() is None and g._violation() is None
    bad, ids = checked(json.dumps([{"name": "old", "age": 151}]).encode())
    for t in ids:
        bad.accept(t)
    assert "151" in bad._violation()


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(1, 6), back=st.integers(0, 40), width=st.integers(1, 7))
def test_rollback_and_copy_keep_the_lexer_with_the_document(n, back, width):
    doc = json.dumps([{"name": 'a"]}' * i, "age": i} for i in range(n)]).encode()
    g, ids = checked(doc, width)
    for t in ids:
        g.accept(t)
    k = min(back, len(ids))
    twin = g.copy()
    g.rollback(k)
    assert g.document == doc[:len(doc) - sum(len(doc[i * width:(i + 1) * width]) for i in ids[len(ids) - k:])]
    for t in ids[len(ids) - k:]:
        g.accept(t)
    for h in (g, twin):
        assert h.document == doc and h._lex[-1] == 0 and h._violation() is None
