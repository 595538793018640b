"""Schema-corpus part of ``benchmarks/constrained.py``: compile, mask and accept/reject each test
instance of the JSON-schema corpus (``../shared/data/jsonschema``) with one grammar backend.

Each backend runs in a worker process, so a compile that exceeds ``compile_timeout`` is ended by
killing the worker (the thread pool cannot cancel a running compile); a timeout counts as a failed
compile. Per schema the worker reports the compile time, and per test instance whether its tokens
were accepted one by one (``fill_mask`` timed before every ``accept``, and the mask checked to
agree with ``accept``).

"Serialized the way the grammar allows": backends emit compact JSON with keys in schema order, and
some of their rules put spaces after separators (xgrammar's untyped values). So an instance is
serialized by a grammar-guided search over *formatting only*: insignificant whitespace between
JSON tokens, the order of an object's keys, ``1.0`` vs ``1`` and ASCII escapes in strings. Values
are never changed, so an invalid instance that any formatting gets accepted is a real grammar
error. The text found (or the compact text, when none is) is then tokenized and walked.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

WHITESPACE = (" ", "\n")  # tried before a JSON token the grammar rejects as is
SEARCH_BUDGET = 5000  # accept_string calls per instance before the search gives up
WALK_TIMEOUT_S = 300.0  # token walks of one schema's instances (never reached in practice)


# ------------------------------------------------------------------------------------ pure helpers


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def compact(value: Any) -> str:
    """The plain serialization the corpus test uses (tests/test_constrained_json_schema.py)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def load_corpus(folder: Path, limit: int = 0, seed: int = 0, files: list[str] | None = None) -> list[dict]:
    """Entries of every ``*.jsonl`` (or of ``files``), each tagged with its ``file``. ``limit`` > 0
    keeps a seeded random sample of that many per file, in file order; a smaller limit with the
    same seed gives a subset of a larger one."""
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        if files and path.stem not in files and path.name not in files:
            continue
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        keep = range(len(entries))
        if 0 < limit < len(entries):
            order = list(keep)
            random.Random(f"{seed}:{path.name}").shuffle(order)
            keep = sorted(order[:limit])
        out += [{**entries[i], "file": path.stem} for i in keep]
    return out


class _Budget(Exception):
    pass


class GuidedSerializer:
    """Finds a formatting of ``value`` that ``grammar`` accepts (see the module docstring), by
    depth-first search with ``accept_string`` and ``rollback``. Generators yield once per way a
    part was consumed and undo their own steps when resumed, so alternatives backtrack cleanly."""

    def __init__(self, grammar: Any, can_end: Callable[[], bool], budget: int = SEARCH_BUDGET):
        self.g, self.can_end, self.budget = grammar, can_end, budget
        self.pieces: list[str] = []
        self.calls = 0

    def serialize(self, value: Any) -> str | None:
        """The accepted text, or None (none found, or the budget ran out: see ``exhausted``)."""
        self.exhausted = False
        try:
            for _ in self._value(value):
                if self.can_end():
                    return "".join(self.pieces)
        except _Budget:
            self.exhausted = True
        return None

    def _lit(self, *alternatives: str) -> Iterator[None]:
        for text in dict.fromkeys(alternatives):
            for ws in ("", *WHITESPACE):
                self.calls += 1
                if self.calls > self.budget:
                    raise _Budget
                if self.g.accept_string(ws + text):
                    self.pieces.append(ws + text)
                    yield
                    self.pieces.pop()
                    self.g.rollback(1)
                    if not ws:
                        break  # the plain form was accepted: spaces before it change nothing new

    def _seq(self, parts: list[Callable[[], Iterator[None]]], i: int = 0) -> Iterator[None]:
        if i == len(parts):
            yield
            return
        for _ in parts[i]():
            yield from self._seq(parts, i + 1)

    def _value(self, v: Any) -> Iterator[None]:
        if isinstance(v, dict):
            yield from self._seq([lambda: self._lit("{"), lambda: self._members(list(v.items()), True)])
        elif isinstance(v, list):
            parts = [lambda: self._lit("[")]
            for k, item in enumerate(v):
                if k:
                    parts.append(lambda: self._lit(","))
                parts.append(lambda item=item: self._value(item))
            parts.append(lambda: self._lit("]"))
            yield from self._seq(parts)
        elif isinstance(v, str):
            yield from self._lit(json.dumps(v, ensure_ascii=False), json.dumps(v))
        elif isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
            yield from self._lit(json.dumps(v), str(int(v)))
        else:
            yield from self._lit(json.dumps(v))

    def _members(self, items: list[tuple[str, Any]], first: bool) -> Iterator[None]:
        if not items:
            yield from self._lit("}")
            return
        for idx, (key, val) in enumerate(items):  # the instance's own order first
            rest = items[:idx] + items[idx + 1:]
            parts = [] if first else [lambda: self._lit(",")]
            parts += [lambda key=key: self._lit(json.dumps(key, ensure_ascii=False), json.dumps(key)),
                      lambda: self._lit(":"), lambda val=val: self._value(val)]
            for _ in self._seq(parts):
                yield from self._members(rest, False)


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def corpus_stats(results: list[dict]) -> dict:
    """Counts and rates over schema results (see CorpusRunner.check); instance rates only count
    schemas that compiled."""
    compiled = [r for r in results if r["compiled"]]
    inst = [i for r in compiled for i in r["instances"]]
    valid = [i for i in inst if i["valid"]]
    invalid = [i for i in inst if not i["valid"]]
    out = {
        "schemas": len(results),
        "compiled": len(compiled),
        "compile_rate": _rate(len(compiled), len(results)),
        "timeouts": sum(r["timeout"] for r in results),
        "valid": len(valid),
        "valid_accepted": sum(i["accepted"] for i in valid),
        "invalid": len(invalid),
        "invalid_rejected": sum(not i["accepted"] for i in invalid),
        "reformatted": sum(i["accepted"] and i["reformatted"] for i in valid),
        "search_exhausted": sum(i["search_exhausted"] for i in inst),
        "mask_disagreements": sum(i["mask_disagreements"] for i in inst),
        # complete documents the grammar accepted that jsonschema rejects: served, and backend alone
        "violations": sum(i["accepted"] and not i["reference_valid"] for i in inst),
        "raw_violations": sum(i["accepted_raw"] and not i["reference_valid"] for i in inst),
        "end_check_schemas": sum(bool(r.get("end_check_only")) for r in compiled),
        "string_token_disagreements": sum(i["text_found"] != i["accepted"] for i in inst),
        "walk_errors": sum("walk_error" in r for r in compiled),
    }
    out["valid_accept_rate"] = _rate(out["valid_accepted"], out["valid"])
    out["invalid_reject_rate"] = _rate(out["invalid_rejected"], out["invalid"])
    return out


def summarize_corpus(results: list[dict]) -> dict:
    """Overall stats with compile and mask-time percentiles, per-file stats, and failures by id."""
    compile_s = [r["compile_s"] for r in results if r["compiled"]]
    mask_us = [t * 1e6 for r in results for t in r.get("mask_times", ())]
    overall = corpus_stats(results)
    overall.update(
        compile_p50_s=percentile(compile_s, 50), compile_p99_s=percentile(compile_s, 99),
        mask_tokens=len(mask_us), mask_p50_us=percentile(mask_us, 50), mask_p99_us=percentile(mask_us, 99),
    )
    files = sorted({r["file"] for r in results})
    per_file = {f: corpus_stats([r for r in results if r["file"] == f]) for f in files}
    failures: dict[str, list] = {"compile": [], "valid_rejected": [], "invalid_accepted": [], "violations": [],
                                 "raw_violations": [], "other": []}
    for r in results:
        if not r["compiled"]:
            failures["compile"].append({"id": r["id"], "error": r["error"]})
        if "walk_error" in r:
            failures["other"].append({"id": r["id"], "error": r["walk_error"]})
        for i in r["instances"]:
            where = {"id": r["id"], "index": i["index"], "description": i["description"]}
            if i["valid"] and not i["accepted"]:
                failures["valid_rejected"].append({**where, "formatting_found": i["text_found"],
                                                   "search_exhausted": i["search_exhausted"]})
            elif not i["valid"] and i["accepted"]:
                failures["invalid_accepted"].append(where)
            if not i["reference_valid"] and i["accepted"]:
                failures["violations"].append(where)
            if not i["reference_valid"] and i["accepted_raw"]:
                failures["raw_violations"].append({**where, "end_check_only": r.get("end_check_only", [])})
            if i["mask_disagreements"] or i["text_found"] != i["accepted"]:
                failures["other"].append({**where, "mask_disagreements": i["mask_disagreements"],
                                          "string_accepted": i["text_found"], "tokens_accepted": i["accepted"]})
    return {"overall": overall, "per_file": per_file, "failures": failures}


# ------------------------------------------------------------------------------------ one schema


class CorpusChecker:
    """Compiles and checks schemas with one backend (runs inside the worker process)."""

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int):
        from radixlm.constrained import create_grammar_backend

        self.tok = tokenizer
        self.backend = create_grammar_backend(backend_name, tokenizer, vocab_size, num_threads=1, cache_size=4)
        self.eos = tokenizer.eos_token_id
        self.bitmask = self.backend.allocate_bitmask(1)
        self.words = self.bitmask[0].numpy()  # a view: reads what fill_mask writes

    def compile(self, spec: str) -> tuple[float, str | None, list[str]]:
        """(seconds, error, keywords only the end check enforces)."""
        t0 = time.perf_counter()
        try:
            g = self.backend.compile("json_schema", spec)
            error, relaxed = None, sorted(getattr(g, "relaxed_keywords", ()))
        except Exception as e:  # GrammarError, or anything the backend raised
            error, relaxed = f"{type(e).__name__}: {e}"[:300], []
        return time.perf_counter() - t0, error, relaxed

    def _allowed(self, token: int) -> bool:
        return bool((int(self.words[token >> 5]) >> (token & 31)) & 1)

    def _can_end(self, grammar: Any) -> Callable[[], bool]:
        def can_end() -> bool:
            grammar.fill_mask(self.bitmask, 0)
            return self._allowed(self.eos)
        return can_end

    def check_instance(self, spec: str, data: Any) -> dict:
        """Search a formatting, then walk its tokens (plus EOS) on a fresh grammar, and once more
        on the backend's own grammar without the end check (``accepted_raw``)."""
        search = GuidedSerializer(self.backend.compile("json_schema", spec), can_end=None)
        search.can_end = self._can_end(search.g)
        found = search.serialize(data)
        text = found if found is not None else compact(data)
        ids = self.tok.encode(text, add_special_tokens=False) + [self.eos]
        g = self.backend.compile("json_schema", spec)
        accepted, disagree, times = self._walk(g, ids)
        raw = getattr(g, "inner", None)  # EndCheckedGrammar: the backend's grammar alone
        accepted_raw = accepted if raw is None else self._walk(self.backend.compile("json_schema", spec).inner, ids)[0]
        return {
            "accepted": accepted,
            "accepted_raw": accepted_raw,
            "end_check_only": sorted(getattr(g, "relaxed_keywords", ())),
            "text_found": found is not None,  # string-level search found an accepted formatting
            "reformatted": found is not None and found != compact(data),
            "search_exhausted": search.exhausted,
            "tokens": len(ids),
            "text": text,  # the document walked (dropped from the saved results)
            "mask_disagreements": disagree,
            "mask_times": times,
        }

    def _walk(self, g: Any, ids: list[int]) -> tuple[bool, int, list[float]]:
        """(all accepted and terminated, mask bits that disagreed with accept, fill_mask times)."""
        times, disagree = [], 0
        for t in ids:
            t0 = time.perf_counter()
            g.fill_mask(self.bitmask, 0)
            times.append(time.perf_counter() - t0)
            ok = g.accept(t)
            # a dead end (complete document the schema rejects) leaves only refused stop tokens
            disagree += ok != self._allowed(t) and not getattr(g, "error_message", None)
            if not ok:
                return False, disagree, times
        return g.is_terminated(), disagree, times


def check_schema_instances(checker: CorpusChecker, entry: dict, spec: str) -> list[dict]:
    """Per test instance: the walk results, the corpus label (``valid``) and what ``jsonschema``
    says of the document walked (``reference_valid``; violations are accepted documents it
    rejects). The walked text, not the instance: reformatting ``1.0`` as ``1`` changes its type
    under draft 4, where ``1.0`` is not an integer."""
    from radixlm.constrained.json_schema import validator_class

    try:
        validator = validator_class(entry["schema"])(entry["schema"])
    except Exception:  # a schema the validator cannot load never compiles either
        validator = None
    out = []
    for i, case in enumerate(entry.get("tests") or []):
        res = checker.check_instance(spec, case["data"])
        try:
            walked = json.loads(res.pop("text"))
            reference = validator.is_valid(walked) if validator is not None else bool(case["valid"])
        except Exception:
            reference = bool(case["valid"])
        res.update(index=i, valid=bool(case["valid"]), reference_valid=reference,
                   description=case.get("description", "")[:120])
        out.append(res)
    return out


# ------------------------------------------------------------------------------------ worker process


def _worker(conn, backend_name: str, tokenizer: Any, vocab_size: int, log_path: str | None) -> None:
    if log_path:  # backends print warnings from C++ straight to fd 2
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
    import torch

    torch.set_num_threads(1)
    checker = CorpusChecker(backend_name, tokenizer, vocab_size)
    conn.send(("ready", None))
    while True:
        entry = conn.recv()
        if entry is None:
            return
        spec = json.dumps(entry["schema"])
        seconds, error, relaxed = checker.compile(spec)
        conn.send(("compiled", (seconds, error, relaxed)))
        if error is None:
            try:
                conn.send(("done", check_schema_instances(checker, entry, spec)))
            except Exception as e:
                conn.send(("crashed", f"{type(e).__name__}: {e}"[:300]))


class CorpusRunner:
    """The parent side: feeds schemas to a worker, restarting it after a timeout.

    Workers are forked (the parent's tokenizer comes along, so a restart takes about a second): call
    this before the parent runs any torch work, and keep ``TOKENIZERS_PARALLELISM=false``."""

    def __init__(self, backend_name: str, tokenizer: Any, vocab_size: int, compile_timeout: float,
                 log_path: str | None = None):
        self.args = (backend_name, tokenizer, vocab_size, log_path)
        self.compile_timeout = compile_timeout
        self.proc = self.conn = None
        self.restarts = 0

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, *self.args), daemon=True)
        self.proc.start()
        child.close()
        kind, _ = self._recv(600)
        assert kind == "ready", kind

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            return "timeout", None
        try:
            return self.conn.recv()
        except EOFError:
            return "died", None

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
        self.proc = None
        self.restarts += 1

    def check(self, entry: dict) -> dict:
        if self.proc is None:
            self._start()
        res = {"id": entry["id"], "file": entry["file"], "compiled": False, "timeout": False,
               "compile_s": None, "error": None, "instances": []}
        self.conn.send(entry)
        kind, payload = self._recv(self.compile_timeout + 0.5)
        if kind != "compiled":
            self._kill()
            res.update(timeout=kind == "timeout", compile_s=self.compile_timeout,
                       error=f"compile took over {self.compile_timeout:g}s" if kind == "timeout" else "worker died")
            return res
        seconds, error, res["end_check_only"] = payload
        res["compile_s"] = seconds
        if error is not None:
            res["error"] = error
            return res
        if seconds > self.compile_timeout:  # the answer arrived within the poll slack
            res.update(timeout=True, error=f"compile took over {self.compile_timeout:g}s")
            kind, _ = self._recv(WALK_TIMEOUT_S)  # drain its instance results
            return res
        res["compiled"] = True
        kind, payload = self._recv(WALK_TIMEOUT_S)
        if kind == "done":
            res["mask_times"] = [t for inst in payload for t in inst.pop("mask_times")]
            res["instances"] = payload
        else:
            if kind in ("timeout", "died"):
                self._kill()
            res["walk_error"] = payload if kind == "crashed" else f"instance walk {kind}"
        return res

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
            self.proc = None
