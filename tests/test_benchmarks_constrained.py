"""Pure helpers of benchmarks/constrained.py and benchmarks/constrained_corpus.py (no model)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import constrained_corpus as cc  # noqa: E402
import constrained_report as report  # noqa: E402

# loaded under another name: "constrained" is also the repo's constrained/ package folder
_spec = importlib.util.spec_from_file_location("bench_constrained", BENCHMARKS / "constrained.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class PrefixGrammar:
    """A stand-in grammar that accepts exactly the strings in ``allowed`` (string-level only)."""

    def __init__(self, allowed: set[str]):
        self.allowed, self.text, self.steps = allowed, "", []

    def accept_string(self, s: str) -> bool:
        if not any(a.startswith(self.text + s) for a in self.allowed):
            return False
        self.text += s
        self.steps.append(len(s))
        return True

    def rollback(self, k: int) -> None:
        for _ in range(k):
            self.text = self.text[: len(self.text) - self.steps.pop()]

    def can_end(self) -> bool:
        return self.text in self.allowed


def serialize(value, allowed: set[str], budget: int = cc.SEARCH_BUDGET):
    g = PrefixGrammar(allowed)
    s = cc.GuidedSerializer(g, g.can_end, budget)
    return s.serialize(value), s, g


def test_percentile_interpolates():
    assert cc.percentile([], 50) is None
    assert cc.percentile([3.0], 99) == 3.0
    assert cc.percentile([1, 2, 3, 4], 50) == 2.5
    assert cc.percentile([4, 1, 3, 2], 0) == 1 and cc.percentile([4, 1, 3, 2], 100) == 4
    assert cc.percentile(list(range(101)), 99) == pytest.approx(99)


def test_compact_matches_the_corpus_test():
    assert cc.compact({"a": [1, 2.5], "é": None}) == '{"a":[1,2.5],"é":null}'


def test_serializer_plain_form_first():
    text, s, g = serialize({"a": 1, "b": [True, None]}, {'{"a":1,"b":[true,null]}'})
    assert text == '{"a":1,"b":[true,null]}' and not s.exhausted and g.steps


def test_serializer_reorders_keys_and_restores_state_on_failure():
    text, _, g = serialize({"b": 2, "a": {"y": 1, "x": 0}}, {'{"a":{"x":0,"y":1},"b":2}'})
    assert text == '{"a":{"x":0,"y":1},"b":2}'
    text, s, g = serialize({"b": 2, "a": 1}, {'{"a":1,"b":3}'})
    assert text is None and not s.exhausted and g.text == ""  # every step rolled back


def test_serializer_inserts_whitespace_and_integral_floats():
    assert serialize({"k": [1.0, 2]}, {'{"k": [1, 2]}'})[0] == '{"k": [1, 2]}'
    assert serialize({"s": "é"}, {'{"s":"\\u00e9"}'})[0] == '{"s":"\\u00e9"}'  # ASCII escapes


def test_serializer_budget():
    class AcceptsAllNeverEnds(PrefixGrammar):
        def accept_string(self, s: str) -> bool:
            self.text += s
            self.steps.append(len(s))
            return True

    g = AcceptsAllNeverEnds(set())
    s = cc.GuidedSerializer(g, lambda: False, budget=200)
    assert s.serialize({f"k{i}": i for i in range(8)}) is None and s.exhausted  # 8! key orders


def test_load_corpus_samples_per_file_and_nests(tmp_path):
    for name, n in (("A", 10), ("B", 3)):
        lines = [json.dumps({"id": f"{name}{i}", "schema": {}, "tests": []}) for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "README.md").write_text("not a corpus file")
    assert len(cc.load_corpus(tmp_path)) == 13
    four = cc.load_corpus(tmp_path, limit=4, seed=1)
    assert [e["file"] for e in four].count("A") == 4 and [e["file"] for e in four].count("B") == 3
    two = cc.load_corpus(tmp_path, limit=2, seed=1)
    assert {e["id"] for e in two} <= {e["id"] for e in four}
    assert cc.load_corpus(tmp_path, limit=4, seed=1) == four
    assert {e["file"] for e in cc.load_corpus(tmp_path, files=["B"])} == {"B"}


def inst(index, valid, accepted, **kw):
    base = {"index": index, "valid": valid, "reference_valid": valid, "accepted": accepted, "accepted_raw": accepted,
            "text_found": accepted, "reformatted": False, "search_exhausted": False, "tokens": 5,
            "mask_disagreements": 0, "description": "d"}
    return {**base, **kw}


def schema_result(id_, file, compiled=True, instances=(), compile_s=0.01, mask_times=(), **kw):
    return {"id": id_, "file": file, "compiled": compiled, "timeout": False, "compile_s": compile_s,
            "error": None if compiled else "bad", "instances": list(instances), "mask_times": list(mask_times), **kw}


def test_summarize_corpus_counts_rates_and_failures():
    results = [
        schema_result("a", "F1", instances=[inst(0, True, True, reformatted=True), inst(1, False, False)],
                      compile_s=0.1, mask_times=[1e-5, 3e-5]),
        schema_result("b", "F1", instances=[inst(0, True, False), inst(1, False, True), inst(2, False, False,
                      accepted_raw=True)], compile_s=0.3, end_check_only=["not"]),
        schema_result("c", "F2", compiled=False, compile_s=0.0),
        schema_result("d", "F2", compiled=False, compile_s=10.0, timeout=True),
    ]
    s = cc.summarize_corpus(results)
    o = s["overall"]
    assert (o["schemas"], o["compiled"], o["timeouts"], o["compile_rate"]) == (4, 2, 1, 0.5)
    assert (o["valid"], o["valid_accepted"], o["invalid"], o["invalid_rejected"]) == (2, 1, 3, 2)
    assert (o["violations"], o["raw_violations"], o["end_check_schemas"]) == (1, 2, 1)
    assert o["reformatted"] == 1 and o["compile_p50_s"] == pytest.approx(0.2) and o["mask_tokens"] == 2
    assert o["mask_p50_us"] == pytest.approx(20)
    assert s["per_file"]["F2"]["valid_accept_rate"] is None and s["per_file"]["F1"]["compiled"] == 2
    f = s["failures"]
    assert [x["id"] for x in f["compile"]] == ["c", "d"]
    assert [(x["id"], x["index"]) for x in f["valid_rejected"]] == [("b", 0)]
    assert [(x["id"], x["index"]) for x in f["invalid_accepted"]] == [("b", 1)]
    assert [(x["id"], x["index"]) for x in f["violations"]] == [("b", 1)]
    assert [(x["id"], x["index"]) for x in f["raw_violations"]] == [("b", 1), ("b", 2)]
    table = "\n".join(report.corpus_tables({"xgrammar": {**s, "overall": {**o, "limit_per_file": 0}}}))
    assert "| xgrammar | all | 4 | 2/4 (50.0%) | 1 | 1 |" in table and "| F1 | xgrammar | 2 | 2/2 (100.0%) |" in table


def test_extraction_texts_are_deterministic_and_distinct():
    a, b = bench.extraction_texts(16, 0), bench.extraction_texts(16, 0)
    assert a == b and len(set(a)) == 16 and all("@example.com" in t for t in a)
    assert bench.extraction_texts(4, 1) != a[:4]
    assert set(bench.JF_SCHEMA["required"]) == set(bench.JF_SCHEMA["properties"])


def test_pick_generation_sample_filters_and_is_seeded():
    entries = [{"id": f"s{i}", "schema": {"type": "object", "description": "x" * i * 10}} for i in range(30)]
    ok = {f"s{i}" for i in range(0, 30, 2)}
    got = bench.pick_generation_sample(entries, ok, 5, 200, seed=3)
    assert len(got) == 5 and all(e["id"] in ok and len(json.dumps(e["schema"])) <= 200 for e in got)
    assert got == bench.pick_generation_sample(entries, ok, 5, 200, seed=3)
    assert len(bench.pick_generation_sample(entries, None, 100, 10_000, seed=0)) == 30


def test_validate_reports_why():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert bench.validate('{"n": 3}', schema) == (True, None)
    ok, why = bench.validate('{"n": "x"}', schema)
    assert not ok and "integer" in why
    ok, why = bench.validate('{"n": 3', schema)
    assert not ok and why.startswith("not JSON")


def run(tok_s, passes=10, wall=1.0, jf=0):
    return {"requests": 2, "output_tokens": 20, "jump_forward_tokens": jf, "forward_passes": passes,
            "wall_s": wall, "tok_s": tok_s, "valid": 2, "grammar_s": 0.25, "sample_s": 0.5}


def test_targets_and_markdown():
    res = {
        "config": {"default_backend": "llguidance"},
        "corpus": {"llguidance": {"overall": {"compile_rate": 0.97, "violations": 0, "limit_per_file": 0}}},
        "generation": {"llguidance": {"schemas": 4, "compliant": 3, "length_cut": 1, "invalid": 0, "aborted": 1,
                                      "dead_ends": 1, "mean_tokens": 40.0}},
        "speed": {"jump-forward on": {32: {"json": run(95), "plain": run(100), "ratio": 0.95}},
                  "jump-forward off": {1: {"json": run(5), "plain": run(10), "ratio": 0.5}}},
        "jump": {"on": run(10, passes=50, wall=2.0, jf=30), "off": run(10, passes=100, wall=3.0)},
    }
    t = {row["target"].split(" >")[0]: row for row in bench.targets(res)}
    assert t["corpus: llguidance (default) coverage"]["met"]
    assert t["corpus: llguidance (default) violations = 0 (whole corpus)"]["met"]
    assert t["generation: llguidance (default) violations = 0"]["met"]
    assert t["speed: JSON / unconstrained tok/s at batch 32"]["met"]  # 0.95x meets ">= 0.95x"
    assert not any("batch 1 " in k for k in t)  # the target is about the large batch
    assert t["jump-forward: forward passes off / on"]["value"] == 2.0
    assert t["jump-forward: wall time off / on"]["met"]
    res["targets"] = bench.targets(res)
    res["corpus"] = {}  # its tables are checked above
    md = bench.markdown(res)
    assert "| jump-forward on | 32 | json | 2 | 20 | 0 | 10 | 1.0 | 0.25 | 0.50 | 95.0 | 0.95x |" in md
    assert "| off / on | | 1.00x | | 2.00x | 1.50x | | |" in md
    assert "| llguidance | 4 | 3/4 (75.0%) | 1 | 3/3 (100.0%) | 0 | 1 (1) | 40.0 |" in md
    assert "| corpus: llguidance (default) violations = 0 (whole corpus) | 0 | yes |" in md


def test_step_timer_wraps_and_restores():
    import radixlm.runtime.sampling.step as step_sampler
    from radixlm.runtime.scheduler.grammars import GrammarManager

    before = (GrammarManager.fill_masks, GrammarManager.advance, step_sampler.sample)
    with bench.StepTimer() as timer:
        assert GrammarManager.fill_masks is not before[0] and step_sampler.sample is not before[2]
        assert GrammarManager.fill_masks(None, [], 8, torch.device("cpu")) is None  # no constrained rows
    assert (GrammarManager.fill_masks, GrammarManager.advance, step_sampler.sample) == before
    assert timer.totals["grammar_s"] > 0 and timer.totals["sample_s"] == 0
