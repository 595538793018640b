"""Offline throughput benchmark: RadixLM (with and without the radix cache) against transformers.

    python benchmarks/offline.py [--model smollm2-135m] [--workloads few-shot,multi-turn,unique,prefill]
        [--systems radixlm,radixlm-nocache,hf-single,hf-batch,hf-forward,radixlm-torch-gemm] [--scale 1.0]
        [--device auto|cpu|cuda] [--dtype auto] [--out benchmarks/results/offline.json]

Every system runs the same tokens: greedy decoding, exactly ``max_new_tokens`` output tokens per
request (EOS ignored). Only generation is timed (model loading and a warm-up request are not).
Workloads are described in ``benchmarks/workloads.py``; columns in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import workloads as wl  # noqa: E402
from offline_systems import ENGINE_SYSTEMS, EngineSystem, HFForwardSystem, HFSystem, RunResult, tokenize  # noqa: E402
from tqdm import tqdm  # noqa: E402

SYSTEMS = ("radixlm", "radixlm-nocache", "hf-single", "hf-batch", "hf-forward", "radixlm-torch-gemm",
           "radixlm-no-overlap", "radixlm-int8", "radixlm-int8-packing-off")
DEFAULT_SYSTEMS = SYSTEMS[:-4]  # the last four only when asked for (CPU kernel, overlap and int8 comparisons)
BASELINES = ("radixlm-nocache", "hf-single", "hf-batch", "hf-forward", "radixlm-torch-gemm", "radixlm-no-overlap",
             "radixlm-int8", "radixlm-int8-packing-off")
# the issues' targets: (workload, baseline) -> minimum radixlm throughput ratio
TARGETS = {("few-shot", "radixlm-nocache"): 10.0, ("few-shot", "hf-single"): 10.0, ("unique", "hf-single"): 3.0,
           ("unique", "radixlm-nocache"): 1.0, ("prefill", "hf-forward"): 1.2}
HIT_TARGET = 0.95  # measured hit rate / optimal hit rate, few-shot


# ------------------------------------------------------------------------------------------ reporting


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def ratio(a: RunResult | None, b: RunResult | None, cpu: bool = False) -> float | None:
    if a is None or b is None:
        return None
    x, y = (a.cpu_tok_s, b.cpu_tok_s) if cpu else (a.tok_s, b.tok_s)
    return x / y if y else None


def summarize(results: list[RunResult]) -> dict:
    by = {(r.workload, r.system): r for r in results}
    summary = {}
    for name in dict.fromkeys(r.workload for r in results):
        rl = by.get((name, "radixlm"))
        s = {f"radixlm_vs_{b}": ratio(rl, by.get((name, b))) for b in BASELINES}
        s.update({f"radixlm_vs_{b}_cpu": ratio(rl, by.get((name, b)), cpu=True) for b in BASELINES})
        if rl is not None and rl.hit_rate is not None and rl.optimal_hit_rate:
            s["hit_over_optimal"] = rl.hit_rate / rl.optimal_hit_rate
        summary[name] = s
    return summary


def check_targets(summary: dict) -> list[dict]:
    rows = []
    for (name, base), goal in TARGETS.items():
        got = summary.get(name, {}).get(f"radixlm_vs_{base}")
        if got is not None:
            rows.append({"target": f"{name}: radixlm vs {base} >= {goal:g}x", "value": got, "met": got >= goal,
                         "value_cpu": summary[name].get(f"radixlm_vs_{base}_cpu")})
    got = summary.get("few-shot", {}).get("hit_over_optimal")
    if got is not None:
        rows.append({"target": f"few-shot: hit rate >= {HIT_TARGET:.0%} of optimal", "value": got,
                     "met": got >= HIT_TARGET})
    return rows


def markdown(results: list[RunResult], summary: dict, targets: list[dict]) -> str:
    by = {(r.workload, r.system): r for r in results}
    lines = [
        "| workload | system | requests | prompt tok | output tok | time (s) | output tok/s | CPU (s) | "
        "tok/CPU-s | hit rate | optimal | hit/optimal | radixlm speedup (wall / CPU) |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results:
        reqs = f"{r.requests}/{r.total_requests} (sampled)" if r.sampled else str(r.requests)
        rl = by.get((r.workload, "radixlm"))
        speed = "—" if r.system == "radixlm" else both(ratio(rl, r), ratio(rl, r, cpu=True))
        hit_opt = (r.hit_rate / r.optimal_hit_rate) if r.hit_rate is not None and r.optimal_hit_rate else None
        lines.append(
            f"| {r.workload} | {r.system} | {reqs} | {r.prompt_tokens} | {r.output_tokens} | {r.time_s:.1f} | "
            f"{r.tok_s:.1f} | {r.cpu_s:.1f} | {r.cpu_tok_s:.1f} | {fmt(r.hit_rate, '.1%')} | "
            f"{fmt(r.optimal_hit_rate if r.system.startswith('radixlm') else None, '.1%')} | "
            f"{fmt(hit_opt, '.1%')} | {speed} |"
        )
    lines += ["", "| workload | " + " | ".join(f"radixlm vs {b}" for b in BASELINES) + " | hit/optimal |",
              "|---|" + "--:|" * (len(BASELINES) + 1)]
    for name, s in summary.items():
        cells = [both(s.get(f"radixlm_vs_{b}"), s.get(f"radixlm_vs_{b}_cpu")) for b in BASELINES]
        lines.append(f"| {name} | {' | '.join(cells)} | {fmt(s.get('hit_over_optimal'), '.1%')} |")
    lines += ["", "(ratios: output tok/s of radixlm over the other system's, by wall time / by CPU time)"]
    if targets:
        lines += ["", "| target | measured (wall / CPU) | met (wall) |", "|---|--:|:-:|"]
        for t in targets:
            if "hit rate" in t["target"]:
                value = fmt(t["value"], ".1%")
            else:
                value = both(t["value"], t.get("value_cpu"))
            lines.append(f"| {t['target']} | {value} | {'yes' if t['met'] else 'no'} |")
    if any(r.sampled for r in results):
        lines += ["", "(sampled): the system ran only the first requests of the workload (hf-single: whole "
                      "conversations; hf-batch: the first requests of every round); its throughput is that "
                      "of the sample."]
    loads = [x for r in results if r.load_average for x in r.load_average]
    if loads:
        lines += ["", f"1-minute load average during the runs: {min(loads):.1f}-{max(loads):.1f} "
                      f"on {os.cpu_count()} CPUs"]
    return "\n".join(lines)


def both(wall: float | None, cpu: float | None) -> str:
    return f"{fmt(wall, '.2f', 'x')} / {fmt(cpu, '.2f', 'x')}"


def agreement(results: list[RunResult]) -> dict:
    """Per workload: how many requests got exactly the same output ids as under radixlm."""
    by = {(r.workload, r.system): r for r in results}
    out = {}
    for r in results:
        ref = by.get((r.workload, "radixlm"))
        if ref is None or r is ref:
            continue
        common = [p for p in r.outputs if p in ref.outputs]
        same = sum(r.outputs[p] == ref.outputs[p] for p in common)
        out.setdefault(r.workload, {})[r.system] = {"same": same, "compared": len(common)}
    return out


def loadavg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def environment(threads: int) -> dict:
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD") or None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "git_commit": commit,
        "git_dirty": bool(status) if status is not None else None,  # uncommitted changes to tracked files
    }


# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", default=",".join(wl.WORKLOADS))
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies the number of requests/conversations of every workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/offline.json")
    p.add_argument("--hf-limit", type=int, default=4,
                   help="hf-single runs only the first N requests (whole conversations) of a workload; 0 = all")
    p.add_argument("--hf-batch-limit", type=int, default=16,
                   help="hf-batch runs only the first N requests of every round (turn); 0 = all")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda; every system")
    p.add_argument("--dtype", default="auto", help="auto = float32 on CPU, bfloat16 on CUDA; every system")
    p.add_argument("--max-total-tokens", type=int, default=None, help="Engine KV pool size")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for w in args.workloads:
        if w not in wl.WORKLOADS:
            p.error(f"unknown workload {w!r}; choose from {', '.join(wl.WORKLOADS)}")
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    if args.scale <= 0:
        p.error("--scale must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/offline.py", *(sys.argv[1:] if argv is None else argv)])
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model

    folder = resolve_model(args.model).folder
    tok = load_tokenizer(folder)

    def render(messages: list[dict]) -> str:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    works = [wl.build(name, args.scale, args.seed, count_tokens=lambda s: len(tokenize(tok, s)), render=render)
             for name in args.workloads]
    tokens = {w.name: [tokenize(tok, r.prompt) for r in w.requests] for w in works}

    limits = {"hf-single": args.hf_limit or None, "hf-batch": args.hf_batch_limit or None}
    # hf-single samples whole conversations; hf-batch the first N requests of every round (whole
    # batches of every turn), so each sample has the workload's prompt shapes
    plan = [(w, s, w.sample(limits.get(s), per_round=s == "hf-batch")) for w in works for s in args.systems
            if s != "hf-forward" or HFForwardSystem.supports(w)]

    print(f"loading {len(args.systems)} system(s) for {args.model} ...", file=sys.stderr, flush=True)
    systems: dict[str, EngineSystem | HFSystem] = {}
    from radixlm.runtime.executor.compute_thread import shared as shared_compute_thread
    from radixlm.runtime.executor.loader import resolve_dtype
    from radixlm.runtime.executor.model_runner import resolve_device

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    engine_kwargs = {"log_level": "warning", "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    for key in ("max_total_tokens", "chunked_prefill_size", "max_running_requests"):
        if getattr(args, key) is not None:
            engine_kwargs[key] = getattr(args, key)
    hf_model = None
    for s in args.systems:
        if s in ENGINE_SYSTEMS:
            systems[s] = EngineSystem(s, args.model, engine_kwargs)
        else:
            if hf_model is None:
                from transformers import AutoModelForCausalLM

                hf_model = shared_compute_thread().run(  # loads on the thread it will run on
                    lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval())
                # ignore_eos: with no EOS in the model's own generation config, generate() runs
                # through EOS tokens like the Engine does (a None in a passed config falls back to it)
                hf_model.generation_config.eos_token_id = None
            hf_tok = copy.deepcopy(tok)
            hf_tok.padding_side = "left"
            if s == "hf-forward":
                systems[s] = HFForwardSystem(s, hf_model, hf_tok)
            else:
                systems[s] = HFSystem(s, hf_model, hf_tok, 1 if s == "hf-single" else args.hf_batch_size)

    results: list[RunResult] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def report(final: bool) -> tuple[dict, str]:
        summary = summarize(results)
        targets = check_targets(summary)
        table = markdown(results, summary, targets)
        data = {
            "command": command,
            "complete": final,
            "wall_s": time.perf_counter() - started,
            "config": dict(vars(args)),
            "environment": environment(torch.get_num_threads()),
            "workloads": {w.name: {"description": w.description, "params": w.params, "requests": len(w.requests),
                                   "rounds": len(w.rounds), "prompt_tokens": sum(map(len, tokens[w.name])),
                                   "output_tokens": w.output_tokens(),
                                   "optimal_hit_rate": wl.optimal_hit_rate(tokens[w.name])} for w in works},
            "results": [r.to_json() for r in results],
            "summary": summary,
            "targets": targets,
            "agreement_with_radixlm": agreement(results),
            "table_markdown": table,
        }
        out.write_text(json.dumps(data, indent=2) + "\n")  # after every run: a crash keeps what was done
        return data, table

    bar = tqdm(total=sum(len(sub.requests) for _, _, sub in plan), unit="req", disable=args.no_progress,
               dynamic_ncols=True)
    try:
        for work, s, sub in plan:
            bar.set_description(f"{work.name}/{s}")
            positions = {id(r): i for i, r in enumerate(work.requests)}
            load0 = loadavg()
            system = systems[s]
            if isinstance(system, EngineSystem):
                res = system.run(sub, positions, bar)
            else:  # transformers on the engines' compute thread: one OpenMP pool for everyone, as a
                # process running transformers alone has (executor/compute_thread.py)
                res = shared_compute_thread().run(system.run, sub, positions, bar)
            res.load_average = (load0, loadavg()) if load0 is not None else None
            res.total_requests = len(work.requests)
            res.optimal_hit_rate = wl.optimal_hit_rate([tokens[work.name][positions[id(r)]] for r in sub.requests])
            results.append(res)
            report(final=False)
    finally:
        bar.close()
        for sys_ in systems.values():
            if isinstance(sys_, EngineSystem):
                sys_.close()

    data, table = report(final=True)
    print()
    print(table)
    print()
    print("same output ids as radixlm (greedy; fp32 batching may flip near-ties):")
    for name, d in data["agreement_with_radixlm"].items():
        print(f"  {name}: " + ", ".join(f"{s} {v['same']}/{v['compared']}" for s, v in d.items()))
    print()
    print(f"command: {command}")
    print(f"wall time {data['wall_s']:.0f}s (including model loading)")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
