"""Multi-tenant trace for scale-out: N replicas with prefix routing vs round-robin, and one server,
in the same run (started by `python benchmarks/serving.py --trace multi-tenant ...`).

Trace: `tenants` distinct system prompts of ~`system_tokens` tokens (a tenant's own words from its
first sentence on), each used by `clients` chat clients holding a `turns`-turn conversation (the
history is resent every turn, with scripted assistant replies so every system sees the same
prompts). Sessions are interleaved across tenants, so at any time most tenants are active.
Requests are streamed greedy `/generate` calls on the chat-rendered prompt, `max_new_tokens` each.

Systems, one after another on the same trace, each starting cold:
  single        one RadixLM server with `replicas` x `replica_threads` torch threads and
                `replicas` x the per-replica KV pool (the same total memory in one cache)
  prefix        `replicas` Ray Serve replicas (one thread, one KV pool each), prefix routing
  round-robin   the same replicas, round-robin routing
Reported: aggregate cache hit rate (cached / prompt tokens, from every response's meta_info) and
output throughput; ratios prefix/single (hit rate) and prefix/round-robin (throughput).
The per-replica pool (`--replica-max-total-tokens`) is what makes routing matter: with prefix
routing each replica holds the system prompts of about tenants/replicas tenants; round-robin makes
every replica hold all of them. 0 gives the server's default pool (usually all fits).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import time
from collections.abc import Callable, Iterator

import serving
import workloads as wl


def build_trace(tenants: int, clients: int, turns: int, system_tokens: int, max_new_tokens: int,
                count_tokens: Callable[[str], int], render: Callable[[list[dict]], str],
                seed: int = 0) -> list[list[wl.Request]]:
    """Sessions (one per client conversation), interleaved across tenants."""
    systems = []
    for t in range(tenants):
        rng = random.Random(f"tenant/{seed}/{t}")
        name = rng.choice(wl.NAMES) + f" {rng.choice(wl.WORDS).capitalize()} Company {t}"
        text = f"You are the support assistant of {name}. Tenant {t} policy handbook follows. "
        while count_tokens(text) < system_tokens:
            text += " ".join(rng.choice(wl.WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ". "
        systems.append(text)
    sessions: list[list[wl.Request]] = []
    for c in range(clients):
        for t in range(tenants):
            rng = random.Random(f"client/{seed}/{t}/{c}")
            history = [{"role": "system", "content": systems[t]}]
            reqs = []
            for turn in range(turns):
                topic = rng.choice(wl.TOPICS)
                history.append({"role": "user", "content": f"Client {c}, question {turn}: tell me about {topic} "
                                f"and the {rng.choice(wl.WORDS)} of the {rng.choice(wl.WORDS)}."})
                reqs.append(wl.Request(render(list(history)), max_new_tokens, group=len(sessions), round=turn))
                reply = " ".join(rng.choice(wl.WORDS) for _ in range(rng.randint(30, 45)))
                history.append({"role": "assistant", "content": f"About {topic}: {reply}."})
            sessions.append(reqs)
    return sessions


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Servers started inside read OMP_NUM_THREADS when their children start."""
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old


def _measure(url: str, sessions: list[list[wl.Request]], concurrency: int, seed: int) -> dict:
    asyncio.run(serving.run_load(url, None, [[wl.Request("Hello", 4, 0, 0)]], 1, 0, 0))  # warm-up
    import httpx

    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    samples, wall = asyncio.run(serving.run_load(url, None, sessions, concurrency, 0, seed))
    return serving.summarize(samples, wall)


def run(args, sessions: list[list[wl.Request]]) -> list[dict]:
    """Runs the three systems; returns one row per system."""
    import ray

    from radixlm.server import launch_server
    from radixlm.server.scaleout import launch_replicas

    per_replica = {"max_total_tokens": args.replica_max_total_tokens} if args.replica_max_total_tokens else {}
    common = {"model": args.model, "log_level": "warning", "max_queued_requests": 4096}
    rows = []
    print(f"single server ({args.replicas * args.replica_threads} threads) ...", file=sys.stderr, flush=True)
    single_pool = {"max_total_tokens": args.replicas * args.replica_max_total_tokens} if per_replica else {}
    with _threads(args.replicas * args.replica_threads):
        handle = launch_server(**common, **single_pool, port=0)
    try:
        rows.append({"system": "single", **_measure(handle.url, sessions, args.concurrency, args.seed)})
    finally:
        handle.shutdown()
    print(serving_row(rows[-1]), file=sys.stderr, flush=True)
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.replicas), include_dashboard=False,
             log_to_driver=False)
    try:
        for router in ("prefix", "round-robin"):
            print(f"{args.replicas} replicas, {router} routing ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            scaled = launch_replicas(args.replicas, router, replica_cpus=1,
                                     env={"OMP_NUM_THREADS": str(args.replica_threads)}, **common, **per_replica,
                                     port=0)
            print(f"  started in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            try:
                rows.append({"system": router, **_measure(scaled.url, sessions, args.concurrency, args.seed)})
            finally:
                scaled.shutdown()
            print(serving_row(rows[-1]), file=sys.stderr, flush=True)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    return rows


def serving_row(r: dict) -> str:
    return (f"| {r['system']} | {r['requests']} | {r['errors']} | {r['hit_rate']:.1%} | {r['output_tok_per_s']:.1f} | "
            f"{r['req_per_s']:.2f} | {r['ttft_p50']:.2f} | {r['e2e_p50']:.2f} |")


def report(rows: list[dict]) -> str:
    lines = ["| system | requests | errors | hit rate | out tok/s | req/s | TTFT p50 (s) | e2e p50 (s) |",
             "|---|---|---|---|---|---|---|---|"] + [serving_row(r) for r in rows]
    by = {r["system"]: r for r in rows}
    if {"single", "prefix", "round-robin"} <= set(by):
        hit = by["prefix"]["hit_rate"] / by["single"]["hit_rate"] if by["single"]["hit_rate"] else float("nan")
        speed = by["prefix"]["output_tok_per_s"] / by["round-robin"]["output_tok_per_s"]
        lines += ["", f"prefix hit rate / single server's: {hit:.3f} (target >= 0.95)",
                  f"prefix throughput / round-robin's: {speed:.2f}x (target >= 1.3x)"]
    return "\n".join(lines)


def add_args(p) -> None:
    g = p.add_argument_group("multi-tenant trace (--trace multi-tenant)")
    g.add_argument("--replicas", type=int, default=2)
    g.add_argument("--tenants", type=int, default=8)
    g.add_argument("--clients", type=int, default=8, help="clients (conversations) per tenant")
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--system-tokens", type=int, default=1000)
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--replica-threads", type=int, default=1, help="torch threads per replica")
    g.add_argument("--replica-max-total-tokens", type=int, default=8192,
                   help="KV pool per replica (the single server gets replicas x this); 0: server default")


def main(args, command: str) -> int:
    import datetime
    import json
    import platform
    from pathlib import Path

    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(args.model).folder)
    sessions = build_trace(args.tenants, args.clients, args.turns, args.system_tokens, args.max_new_tokens,
                           count_tokens=lambda s: len(tok(s).input_ids),
                           render=lambda m: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                           seed=args.seed)
    args.concurrency = max(int(c) for c in str(args.concurrency).split(",") if c.strip())
    rows = run(args, sessions)
    text = report(rows)
    print(text)
    out = args.out if args.out != "benchmarks/results/serving.json" else "benchmarks/results/multi_tenant.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({
        "command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "trace": {"tenants": args.tenants, "clients_per_tenant": args.clients, "turns": args.turns,
                  "system_tokens": args.system_tokens, "max_new_tokens": args.max_new_tokens,
                  "requests": sum(len(s) for s in sessions), "concurrency": args.concurrency},
        "rows": rows, "report": text,
    }, indent=1))
    return 0 if all(r["errors"] == 0 for r in rows) else 1
