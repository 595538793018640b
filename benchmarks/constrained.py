"""Constrained-decoding benchmark: schema corpus (compile, mask, accept/reject, violations),
generation compliance, JSON-constrained vs unconstrained speed, and jump-forward on vs off.

    python benchmarks/constrained.py [--backends llguidance,xgrammar,outlines] [--limit 0]
        [--stages corpus,generate,speed,jump] [--corpus-from earlier.json] [--out ...json]

Stages (see the "Constrained decoding" section of benchmarks/README.md for every column):
- corpus: every backend over ../shared/data/jsonschema (``--limit N``: a seeded sample of N per
  file; default: all of it); compiles over ``--compile-timeout`` count as failures. Violations are
  test instances the grammar accepted (every token, then EOS) that ``jsonschema`` rejects, as
  served (with the end check) and for the backend's grammar alone. See constrained_corpus.py.
- generate: N schemas that compiled (on every ``--gen-backends``), prompted through the chat
  template, greedy, validated with ``jsonschema``; an output cut by max_new_tokens is non-compliant.
  ``--gen-relaxed N`` more for the default backend among schemas whose grammar was relaxed (the end
  check alone enforces some keywords): dead ends show up there.
- speed: the same prompts at batch 1 (one at a time) and 32, JSON-constrained on an engine with
  jump-forward on and on one with it off (the default backend), each followed on the same engine by
  unconstrained decoding of exactly as many tokens per request (ignore_eos + max_new_tokens set to
  what the constrained run produced): with jump-forward off both sides run the same decode steps,
  so the difference is the grammar's cost. The scheduler's time in grammar work and in sampling is
  measured by wrapping those functions (StepTimer). ``--repeats N`` keeps the fastest of N.
- jump: a JSON-extraction workload (long fixed keys), jump-forward on vs off: forward passes
  (from get_server_info) and wall time.
Timed runs follow an untimed warm-up of the same prompts (grammars compiled, prompts cached).
Results: markdown tables on stdout, everything (failures by id too) in ``--out`` (written after
the corpus stage already, then again at the end).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import constrained_corpus as cc  # noqa: E402
from constrained_report import markdown, targets  # noqa: E402,F401 (targets: part of this module's API)

from radixlm.runtime.engine_args import EngineArgs  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "data" / "jsonschema"
STAGES = ("corpus", "generate", "speed", "jump")
PROMPT = "Produce a JSON object for this schema: {schema}"
JF_PROMPT = "Extract the customer record from: {text}"
JF_SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 40},
        "customer_email_address": {"type": "string", "maxLength": 48},
        "account_creation_date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "customer_phone_number": {"type": "string", "maxLength": 24},
        "shipping_address_city": {"type": "string", "maxLength": 32},
        "loyalty_program_tier": {"enum": ["bronze", "silver", "gold", "platinum"]},
        "is_newsletter_subscriber": {"type": "boolean"},
        "total_lifetime_orders": {"type": "integer", "minimum": 0},
    },
    "additionalProperties": False,
}
JF_SCHEMA["required"] = list(JF_SCHEMA["properties"])
FIRST = ("Ada", "Bruno", "Chen", "Dara", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena")
LAST = ("Lovelace", "Silva", "Wei", "Okafor", "Petrova", "Haddad", "Hopper", "Tanaka", "Moreau", "Berg")
CITIES = ("Lisbon", "Nairobi", "Osaka", "Toronto", "Lyon", "Tallinn", "Quito", "Perth", "Accra", "Bergen")


# ------------------------------------------------------------------------------------------ workloads


def extraction_texts(n: int, seed: int) -> list[str]:
    """Deterministic customer notes for the jump-forward workload."""
    rng, out = random.Random(seed), []
    for k in range(n):
        first, last, city = rng.choice(FIRST), rng.choice(LAST), rng.choice(CITIES)
        date = f"20{rng.randint(10, 24):02d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        out.append(
            f"Support ticket {1000 + k}: {first} {last} wrote from {first.lower()}.{last.lower()}@example.com. "
            f"Customer since {date}, phone +1 555 {rng.randint(100, 999)} {rng.randint(1000, 9999)}, ships to "
            f"{city}. Tier: {rng.choice(['bronze', 'silver', 'gold', 'platinum'])}. "
            f"Newsletter: {rng.choice(['yes', 'no'])}. Orders so far: {rng.randint(0, 80)}."
        )
    return out


def pick_generation_sample(entries: list[dict], ok_ids: set[str] | None, n: int, max_chars: int,
                           seed: int) -> list[dict]:
    """``n`` schemas (seeded) whose JSON fits ``max_chars``, among ``ok_ids`` when given."""
    pool = [e for e in entries if (ok_ids is None or e["id"] in ok_ids) and len(json.dumps(e["schema"])) <= max_chars]
    rng = random.Random(seed)
    return sorted(rng.sample(pool, min(n, len(pool))), key=lambda e: e["id"])


def validate(text: str, schema: dict) -> tuple[bool, str | None]:
    """(valid, why not) for one output against its schema, with the schema's own draft."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as e:
        return False, f"not JSON: {e}"
    try:
        cls = jsonschema.validators.validator_for(schema)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(value))
    except Exception as e:  # a schema the validator itself cannot handle
        return False, f"validator error: {type(e).__name__}: {e}"[:200]
    return error is None, None if error is None else error.message[:200]


# ------------------------------------------------------------------------------------------ engine runs


class StepTimer:
    """Adds up, while active, the scheduler's time in grammar work (GrammarManager.fill_masks,
    advance, jump_forward) and in sampling (which applies the mask), by wrapping them in place."""

    def __init__(self):
        import radixlm.runtime.sampling.step as step_sampler
        from radixlm.runtime.scheduler.grammars import GrammarManager

        self.targets = [(GrammarManager, n, "grammar_s") for n in ("fill_masks", "advance", "jump_forward")]
        self.targets.append((step_sampler, "sample", "sample_s"))
        self.totals = {"grammar_s": 0.0, "sample_s": 0.0}

    def _wrap(self, fn, key):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[key] += time.perf_counter() - t0
        return timed

    def __enter__(self) -> StepTimer:
        self.saved = [(obj, name, getattr(obj, name)) for obj, name, _ in self.targets]
        for (obj, name, key), (_, _, fn) in zip(self.targets, self.saved):
            setattr(obj, name, self._wrap(fn, key))
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, fn in self.saved:
            setattr(obj, name, fn)


def timed_generate(engine, prompts: list[str], params: list[dict], sequential: bool = False) -> dict:
    """Warm-up (1 token, same constraint), then the timed run; totals and per-request outputs."""
    warm = [{**p, "max_new_tokens": 1, "ignore_eos": False} for p in params]
    engine.generate(prompts, warm)
    info0 = engine.get_server_info()
    with StepTimer() as timer:
        t0 = time.perf_counter()
        if sequential:
            outs = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
        else:
            outs = engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    metas = [o["meta_info"] for o in outs]
    tokens = sum(m["completion_tokens"] for m in metas)
    info = engine.get_server_info()
    return {
        "requests": len(prompts),
        "output_tokens": tokens,
        "jump_forward_tokens": sum(m.get("jump_forward_tokens", 0) for m in metas),
        "forward_passes": info["forward_passes"] - info0["forward_passes"],
        "overlapped_steps": info["overlapped_steps"] - info0["overlapped_steps"],
        "wall_s": wall,
        "tok_s": tokens / wall if wall > 0 else None,
        **timer.totals,
        "finish": [m["finish_reason"]["type"] for m in metas],
        "lengths": [m["completion_tokens"] for m in metas],
        "texts": [o["text"] for o in outs],
    }


def run_generation(engine, sample: list[dict], prompts: list[str], max_new_tokens: int) -> dict:
    params = [{"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(e["schema"])}
              for e in sample]
    outs = engine.generate(prompts, params)
    rows = []
    for e, o in zip(sample, outs):
        meta, fin = o["meta_info"], o["meta_info"]["finish_reason"]
        row = {"id": e["id"], "finish": fin["type"], "tokens": meta["completion_tokens"],
               "jump_forward_tokens": meta.get("jump_forward_tokens", 0), "text": o["text"][:400]}
        if fin["type"] == "abort":
            row.update(compliant=False, error=fin.get("message", "")[:200])
        elif fin["type"] == "length":
            row.update(compliant=False, error=f"cut at max_new_tokens={max_new_tokens}")
        else:
            ok, why = validate(o["text"], e["schema"])
            row.update(compliant=ok, error=why)
        rows.append(row)
    n = len(rows)
    return {
        "schemas": n,
        "compliant": sum(r["compliant"] for r in rows),
        "compliance_rate": sum(r["compliant"] for r in rows) / n if n else None,
        "length_cut": sum(r["finish"] == "length" for r in rows),
        "aborted": sum(r["finish"] == "abort" for r in rows),
        # the end check refused a complete document (a 400 naming the keywords it alone enforces)
        "dead_ends": sum(r["finish"] == "abort" and "violates the JSON schema" in (r.get("error") or "") for r in rows),
        "invalid": sum(r["finish"] == "stop" and not r["compliant"] for r in rows),
        "mean_tokens": sum(r["tokens"] for r in rows) / n if n else None,
        "outputs": rows,
    }


def speed_runs(engine, prompts: list[str], schemas: list[str], max_new_tokens: int,
               batches: dict[int, int], repeats: int = 1) -> dict:
    """Per batch size: the JSON-constrained run, then (same engine, right after) unconstrained
    decoding of exactly as many tokens per request; batch 1 runs its requests one at a time. With
    ``repeats`` > 1 the pair is run that many times (alternating) and each side keeps its fastest."""
    out = {}
    for bs, n in batches.items():
        ps, ss = cycle(prompts, n), cycle(schemas, n)
        json_params = [{"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": s} for s in ss]
        best: dict[str, dict] = {}
        for _ in range(repeats):
            runs = {"json": timed_generate(engine, ps, json_params, sequential=bs == 1)}
            plain_params = [{"temperature": 0, "max_new_tokens": k, "ignore_eos": True}
                            for k in runs["json"]["lengths"]]
            runs["plain"] = timed_generate(engine, ps, plain_params, sequential=bs == 1)
            for kind, r in runs.items():
                if kind not in best or r["wall_s"] < best[kind]["wall_s"]:
                    best[kind] = r
        out[bs] = {**best, "ratio": best["json"]["tok_s"] / best["plain"]["tok_s"], "repeats": repeats}
    return out


def jump_run(engine, prompts: list[str], max_new_tokens: int) -> dict:
    params = [{"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(JF_SCHEMA)}] * len(prompts)
    res = timed_generate(engine, prompts, params)
    res["valid"] = sum(f == "stop" and validate(t, JF_SCHEMA)[0] for f, t in zip(res["finish"], res["texts"]))
    return res


def cycle(items: list, n: int) -> list:
    return [items[i % len(items)] for i in range(n)]


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--files", default="", help="comma-separated corpus files (stems); default all")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--backends", default="llguidance,xgrammar,outlines", help="backends for the corpus stage")
    p.add_argument("--default-backend", default=EngineArgs().grammar_backend,
                   help="the backend of the speed and jump stages (the runtime's default)")
    p.add_argument("--limit", type=int, default=0, help="schemas per corpus file (seeded sample); 0 = all")
    p.add_argument("--outlines-limit", type=int, default=0,
                   help="the same for outlines (a subset of the --limit sample); 0 = as --limit")
    p.add_argument("--corpus-from", default="",
                   help="comma-separated --out files of earlier corpus runs: their corpus results are reused "
                        "(and shown) instead of running the corpus stage")
    p.add_argument("--compile-timeout", type=float, default=10.0, help="seconds; longer counts as a failure")
    p.add_argument("--gen-backends", default="llguidance,xgrammar,outlines")
    p.add_argument("--gen-samples", type=int, default=20)
    p.add_argument("--gen-relaxed", type=int, default=10,
                   help="generation: also this many schemas whose default-backend grammar was relaxed (needs the "
                        "corpus stage): how often the end check meets a dead end")
    p.add_argument("--gen-max-schema-chars", type=int, default=1500, help="keeps prompts short")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--speed-max-new-tokens", type=int, default=64,
                   help="speed stage: JSON outputs are cut here (the unconstrained side matches their lengths)")
    p.add_argument("--repeats", type=int, default=1, help="speed stage: runs per pair, fastest kept")
    p.add_argument("--batch", type=int, default=32, help="the large batch of the speed stage")
    p.add_argument("--bs1-prompts", type=int, default=2, help="requests run one at a time at batch 1")
    p.add_argument("--jf-prompts", type=int, default=16)
    p.add_argument("--jf-max-new-tokens", type=int, default=192)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/constrained.json"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("stages", "backends", "gen_backends", "files"):
        setattr(args, name, [s.strip() for s in getattr(args, name).split(",") if s.strip()])
    bad = [s for s in args.stages if s not in STAGES]
    if bad:
        p.error(f"unknown stage(s) {bad}; choose from {', '.join(STAGES)}")
    return args


def run_corpus(args, tokenizer, vocab_size: int) -> tuple[dict, list[dict]]:
    from tqdm import tqdm

    entries = cc.load_corpus(args.corpus, args.limit, args.seed, args.files)
    out = {}
    for name in args.backends:
        limit = args.outlines_limit if name == "outlines" and args.outlines_limit else args.limit
        todo = entries if limit == args.limit else cc.load_corpus(args.corpus, limit, args.seed, args.files)
        log = args.out.parent / f"constrained-{name}-stderr.log"
        log.unlink(missing_ok=True)
        runner = cc.CorpusRunner(name, tokenizer, vocab_size, args.compile_timeout, str(log))
        results, t0 = [], time.perf_counter()
        for e in tqdm(todo, desc=f"corpus/{name}", disable=args.no_progress, dynamic_ncols=True):
            results.append(runner.check(e))
        runner.close()
        summary = cc.summarize_corpus(results)
        summary["overall"].update(wall_s=time.perf_counter() - t0, worker_restarts=runner.restarts,
                                  limit_per_file=limit)
        summary["schemas"] = [{k: r.get(k) for k in ("id", "file", "compiled", "timeout", "compile_s", "error",
                                                     "end_check_only")}
                              for r in results]
        out[name] = summary
    return out, entries


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = os.getloadavg()  # the machine may be shared: timings depend on it
    command = shlex.join(["python", "benchmarks/constrained.py", *(sys.argv[1:] if argv is None else argv)])
    from radixlm.runtime.executor.loader import load_config, load_tokenizer, resolve_model

    folder = resolve_model(args.model).folder
    tok, vocab_size = load_tokenizer(folder), load_config(folder).vocab_size
    args.out.parent.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": command, "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    corpus, entries = ({}, cc.load_corpus(args.corpus, args.limit, args.seed, args.files))
    for path in [p for p in args.corpus_from.split(",") if p]:
        corpus.update(json.loads(Path(path).read_text())["corpus"])
    if "corpus" in args.stages:  # first: workers are forked before this process runs torch work
        ran, entries = run_corpus(args, tok, vocab_size)
        corpus.update(ran)
    res["corpus"] = corpus
    if "corpus" in args.stages:  # saved now: the corpus stage can take hours, the rest may fail
        args.out.write_text(json.dumps(res, indent=1) + "\n")

    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from radixlm.runtime import Engine

    ok_ids = None
    for name in args.gen_backends:
        if name in corpus:
            ids = {s["id"] for s in corpus[name]["schemas"] if s["compiled"]}
            ok_ids = ids if ok_ids is None else ok_ids & ids
    sample = pick_generation_sample(entries, ok_ids, args.gen_samples, args.gen_max_schema_chars, args.seed)
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                add_generation_prompt=True)
    prompts = [chat(PROMPT.format(schema=json.dumps(e["schema"]))) for e in sample]
    schemas = [json.dumps(e["schema"]) for e in sample]
    jf_prompts = [chat(JF_PROMPT.format(text=t)) for t in extraction_texts(args.jf_prompts, args.seed)]
    batches = {1: args.bs1_prompts, args.batch: args.batch}
    relaxed_ids = {s["id"] for s in corpus.get(args.default_backend, {}).get("schemas", []) if s.get("end_check_only")}
    relaxed = pick_generation_sample(entries, relaxed_ids, args.gen_relaxed, args.gen_max_schema_chars, args.seed) \
        if relaxed_ids and args.gen_relaxed else []
    relaxed_prompts = [chat(PROMPT.format(schema=json.dumps(e["schema"]))) for e in relaxed]
    res.update(generation={}, speed={}, jump={}, sample_ids=[e["id"] for e in sample],
               relaxed_sample_ids=[e["id"] for e in relaxed])
    need_speed, need_jump = "speed" in args.stages and sample, "jump" in args.stages
    kw = dict(model=args.model, max_total_tokens=args.max_total_tokens, log_level="warning")
    speed_args = (prompts, schemas, args.speed_max_new_tokens, batches, args.repeats)

    def stage(label: str):
        print(f"[{time.strftime('%H:%M:%S')}] {label}", file=sys.stderr, flush=True)

    default = args.default_backend
    for backend in dict.fromkeys([default, *args.gen_backends]):
        gen = "generate" in args.stages and backend in args.gen_backends and sample
        if not (gen or backend == default and (need_speed or need_jump)):
            continue
        with Engine(grammar_backend=backend, **kw) as engine:
            if gen:
                stage(f"generate/{backend}")
                res["generation"][backend] = run_generation(engine, sample, prompts, args.max_new_tokens)
                if relaxed and backend == args.default_backend:
                    stage(f"generate/{backend} (relaxed schemas)")
                    res["generation"][f"{backend} (relaxed schemas)"] = run_generation(
                        engine, relaxed, relaxed_prompts, args.max_new_tokens)
            if backend == default and need_speed:
                stage("speed/jump-forward on")
                res["speed"]["jump-forward on"] = speed_runs(engine, *speed_args)
            if backend == default and need_jump:
                stage("jump/on")
                res["jump"]["on"] = jump_run(engine, jf_prompts, args.jf_max_new_tokens)
    if need_speed or need_jump:
        with Engine(grammar_backend=default, disable_jump_forward=True, **kw) as engine:
            if need_speed:
                stage("speed/jump-forward off")
                res["speed"]["jump-forward off"] = speed_runs(engine, *speed_args)
            if need_jump:
                stage("jump/off")
                res["jump"]["off"] = jump_run(engine, jf_prompts, args.jf_max_new_tokens)

    res["targets"] = targets(res)
    res["environment"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
    }
    table = markdown(res)
    res["table_markdown"] = table
    print()
    print(table)
    print()
    print(f"command: {command}")
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
