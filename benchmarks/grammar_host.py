"""The host's share of a JSON-constrained batch: the real engine, grammars and sampling, with the
model's forward replaced by host_overhead.py's free stub, so every step is host work only (on a GPU
this is what the device waits for between a constrained batch's steps).

    python benchmarks/grammar_host.py [--batch 32] [--max-new-tokens 128] [--rounds 3]
        [--grammar-backend llguidance] [--stub-sleep-ms MS | --model NAME] [--json PATH] [--no-progress]

Per round: constrained.py's speed-stage requests (its extraction prompts and JSON schema, greedy),
on host_overhead.py's tiny random model with the built-in tokenizer (49,152 tokens), after a
one-token warm-up of the same requests (constrained.timed_generate). The stub's logits are random,
so the grammar decides the outputs; every output that stops is validated against the schema (a
failure raises). Printed per round: wall time, forward passes, output and jump-forward tokens,
and the time in grammar calls (masks, advance, jump-forward) and in sampling.

`--model NAME` runs that model's own forward instead of the stub (its outputs then depend on it).
`--stub-sleep-ms` makes the stub sleep that long per forward with the GIL released (host_overhead.py's
sleeping stub, a stand-in for a GPU's forward): host work that runs beside the forward, as the
scheduler's filling of the grammar masks does, then costs nothing, and what follows the forward adds
to each step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import host_overhead as ho  # noqa: E402
import torch  # noqa: E402
from gpu_workloads import bench_constrained  # noqa: E402 (constrained.py by path: constrained/ is a package too)
from tqdm import tqdm  # noqa: E402

from radixlm.runtime import Engine  # noqa: E402

bc = bench_constrained()


def run(batch: int, max_new_tokens: int, rounds: int, backend: str | None, progress: bool,
        sleep_ms: float = 0.0, model: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="radixlm-grammar-host-") as tmp:
        folder = model or str(ho.build_tiny_model(Path(tmp), max_positions=4096))
        extra = {"grammar_backend": backend} if backend else {}
        engine = Engine(model=folder, log_level="warning", max_running_requests=max(64, batch), **extra)
        try:
            if model is None:
                stub = ho.StubForward(engine.runner)
                stub.sleep_s = sleep_ms / 1e3
                engine.runner.forward = stub  # the instance attribute shadows the method
            tok = engine.tokenizer
            prompts = [tok.apply_chat_template([{"role": "user", "content": bc.JF_PROMPT.format(text=t)}],
                                               tokenize=False, add_generation_prompt=True)
                       for t in bc.extraction_texts(batch, 0)]
            params = [{"temperature": 0, "max_new_tokens": max_new_tokens, "json_schema": json.dumps(bc.JF_SCHEMA)}]
            rows = []
            for _ in tqdm(range(rounds), desc="rounds", disable=not progress):
                engine.flush_cache()
                r = bc.timed_generate(engine, prompts, params * batch)
                for finish, text in zip(r["finish"], r["texts"]):
                    ok, why = bc.validate(text, bc.JF_SCHEMA) if finish == "stop" else (True, None)
                    if not ok:
                        raise AssertionError(f"a stopped output breaks the schema ({why}): {text!r}")
                rows.append({k: r[k] for k in ("wall_s", "forward_passes", "output_tokens", "jump_forward_tokens",
                                               "grammar_s", "sample_s")}
                            | {"stopped": sum(f == "stop" for f in r["finish"])})
            return {"batch": batch, "max_new_tokens": max_new_tokens, "sleep_ms": sleep_ms, "model": model,
                    "vocab": engine.runner.vocab_size, "kv_slots": engine.runner.allocator.num_slots, "rounds": rows}
        finally:
            engine.shutdown()


def markdown(report: dict) -> str:
    lines = ["| round | wall (s) | steps | ms / step | output tokens | by jump-forward | grammar (s) | sampling (s) |",
             "|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for i, r in enumerate(report["rounds"]):
        per_step = 1e3 * r["wall_s"] / r["forward_passes"]
        lines.append(f"| {i} | {r['wall_s']:.3f} | {r['forward_passes']} | {per_step:.2f} | {r['output_tokens']} "
                     f"| {r['jump_forward_tokens']} | {r['grammar_s']:.3f} | {r['sample_s']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--grammar-backend", default=None, help="the engine's default when not given")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--stub-sleep-ms", type=float, default=0.0, help="the stub's forward sleeps this long (0: free)")
    p.add_argument("--model", default=None, help="a real model's forward (e.g. smollm2-135m) instead of the stub")
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.batch < 1 or args.max_new_tokens < 1 or args.rounds < 1 or args.stub_sleep_ms < 0:
        p.error("--batch, --max-new-tokens and --rounds must be >= 1, --stub-sleep-ms >= 0")
    if args.model and args.stub_sleep_ms:
        p.error("--stub-sleep-ms is the stub's: a --model runs its own forward")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.batch, args.max_new_tokens, args.rounds, args.grammar_backend, not args.no_progress,
                 args.stub_sleep_ms, args.model)
    print()
    print(markdown(report))
    walls = [r["wall_s"] for r in report["rounds"][1:]] or [report["rounds"][0]["wall_s"]]
    forward = (f"{args.model}'s own forward" if args.model else
               f"stub forward sleeping {args.stub_sleep_ms:g} ms" if args.stub_sleep_ms else "free stub forward")
    print(f"\nbatch {report['batch']}, {report['max_new_tokens']} new tokens at most, {forward}, "
          f"{report['kv_slots']} KV slots, torch {torch.get_num_threads()} threads; "
          f"median wall after the first round {statistics.median(walls):.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
