"""KV snapshots (time to first token from a snapshot, save and load speed, decode beside a save), in one
run, on the built-in model (SmolLM2-135M) on this CPU:

    python benchmarks/cache_snapshot.py [--model smollm2-135m] [--system-tokens 1700] [--cache-tokens 16384]
        [--repeats 2] [--batch 8] [--new-tokens 48] [--threads 0] [--only ttft,io,throughput]
        [--json benchmarks/results/cache_snapshot.json]

ttft: a server (real processes, `launch_server`) with `--cache-snapshot` answers one chat request
whose system prompt is ~`--system-tokens` tokens (workloads.prefill's policy prompt) and is stopped:
its shutdown saves the cache. Then, `--repeats` times, two fresh servers each answer the same first
request (that system prompt, another question, one new token): one cold, one that loaded (a copy
of) the snapshot at start-up, so only the system prompt and the chat template's first tokens can
hit. TTFT = wall time of that request (prefill + one token, over HTTP). Target: restored <= 0.2 x
cold.

io: an Engine whose cache holds more than `--cache-tokens` tokens (distinct ~1,700-token prompts,
prefill only) saves its hottest `--cache-tokens` (cache_snapshot_max_tokens) with `save_cache`;
fresh Engines load it at start-up (the whole load before the first request) and at run time
(`load_cache`: verified off the scheduler thread, inserted 2,048 tokens per loop iteration). Wall
times of each call; target < 2 s each. The file was just written, so reads come from the page cache.

throughput: on that Engine (the full cache), `--batch` streamed greedy requests of `--new-tokens`
tokens (EOS ignored), alternately with and without a save started once decoding runs; output tok/s
of each run and the longest gap between two tokens of one request (a stalled scheduler shows there).
Target: the with-save mean within the spread of the runs without.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402

QUESTIONS = ("Which policy covers a late delivery?", "Who answers questions about refunds on weekends?")


def system_prompt(tokenizer, tokens: int) -> list[dict]:
    """workloads.prefill's first policy chat (its system message), sized with the real tokenizer and
    chat template."""
    last: list = [None]

    def render(messages: list[dict]) -> str:
        last[0] = messages  # prefill renders the final chat last
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    workloads.prefill(1, tokens, count_tokens=lambda text: len(tokenizer(text)["input_ids"]), render=render)
    return [last[0][0]]


# ------------------------------------------------------------------------------------------ ttft
def first_request(url: str, messages: list[dict]) -> tuple[float, int]:
    import httpx

    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    return seconds, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def bench_ttft(args, tokenizer, folder: Path) -> dict:
    from radixlm.server.launch import launch_server

    system = system_prompt(tokenizer, args.system_tokens)
    snap = folder / "ttft.safetensors"
    server = {"model": args.model, "port": 0, "log_level": "warning", "max_total_tokens": 8192}
    with launch_server(**server, cache_snapshot=str(snap)) as h:
        first_request(h.url, system + [{"role": "user", "content": QUESTIONS[0]}])
    ask = system + [{"role": "user", "content": QUESTIONS[1]}]
    cold, restored, cached = [], [], []
    for i in range(args.repeats):
        with launch_server(**server) as h:
            cold.append(first_request(h.url, ask)[0])
        copy = folder / f"ttft-{i}.safetensors"  # its shutdown saves there: the next repeat starts as the first
        shutil.copy(snap, copy)
        with launch_server(**server, cache_snapshot=str(copy)) as h:
            seconds, hit = first_request(h.url, ask)
            restored.append(seconds)
            cached.append(hit)
    text = tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
    prompt_tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    ratio = statistics.median(restored) / statistics.median(cold)
    return {"prompt_tokens": prompt_tokens, "cold_s": cold, "restored_s": restored, "cached_tokens": cached,
            "ratio": ratio, "target": 0.2, "met": ratio <= 0.2 and min(cached) > 0}


# ------------------------------------------------------------------------------------------ io + throughput
def fill(engine, tokenizer, tokens: int) -> int:
    """Distinct ~1,700-token prompts, prefill only, until the cache holds more than `tokens`."""
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    n = tokens // 1700 + 2
    prompts = [r.prompt for r in workloads.prefill(n, 1700, seed=1, count_tokens=count).requests]
    engine.generate(prompts, [{"max_new_tokens": 0}] * n)
    return engine.get_server_info()["cache"]["evictable_size"]


def decode_run(engine, batch: int, new_tokens: int, during=None) -> dict:
    """`batch` streamed requests at once; `during()` runs on its own thread once every request has
    its first token."""
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    started = threading.Barrier(batch + 1)
    prompts = [f"Write a story about {w} number {i}." for i, w in enumerate(workloads.WORDS[:batch])]

    def one(prompt: str) -> list[float]:
        stamps = []
        for n, _ in enumerate(engine.generate(prompt, params, stream=True)):
            stamps.append(time.perf_counter())
            if n == 0:
                started.wait(timeout=600)
        return stamps

    with cf.ThreadPoolExecutor(batch + 1) as pool:
        t0 = time.perf_counter()
        runs = [pool.submit(one, p) for p in prompts]
        started.wait(timeout=600)
        side = pool.submit(during) if during is not None else None
        stamps = [r.result() for r in runs]
        extra = side.result() if side is not None else None
    end = max(s[-1] for s in stamps)
    decode_start = max(s[0] for s in stamps)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:])]
    return {"tok_s": batch * (new_tokens - 1) / (end - decode_start), "wall_s": end - t0, "max_gap_s": max(gaps),
            "median_gap_s": statistics.median(gaps), "save": extra}


def bench_io_and_throughput(args, tokenizer, folder: Path, only: set[str]) -> dict:
    from radixlm.runtime import Engine

    snap = folder / "io.safetensors"
    out: dict = {}
    common = {"model": args.model, "log_level": "warning", "max_total_tokens": args.cache_tokens + 8192,
              "cache_snapshot_max_tokens": args.cache_tokens}
    with Engine(**common) as e:
        t = time.perf_counter()
        cached = fill(e, tokenizer, args.cache_tokens)
        out["fill"] = {"cached_tokens": cached, "seconds": time.perf_counter() - t}
        t = time.perf_counter()
        saved = e.save_cache(snap)
        out["save"] = {"seconds": time.perf_counter() - t, **saved}
        if "throughput" in only:
            rows = []
            for i in range(2 * args.repeats + 1):
                with_save = i % 2 == 1
                during = (lambda: e.save_cache(folder / "during.safetensors")) if with_save else None
                rows.append({"with_save": with_save, **decode_run(e, args.batch, args.new_tokens, during)})
            base = [r["tok_s"] for r in rows if not r["with_save"]]
            saving = [r["tok_s"] for r in rows if r["with_save"]]
            out["throughput"] = {"runs": rows, "without_mean": statistics.mean(base), "without_min": min(base),
                                 "without_max": max(base), "with_save_mean": statistics.mean(saving),
                                 "ratio": statistics.mean(saving) / statistics.mean(base)}
    del e
    gc.collect()  # one KV pool at a time
    t = time.perf_counter()
    with Engine(**common, cache_snapshot=str(snap)) as e:
        started = time.perf_counter() - t
        out["load_startup"] = {"engine_start_s": started, **e.cache_info()["snapshot"]["last_load"]}
    del e
    gc.collect()
    with Engine(**common) as e:
        t = time.perf_counter()
        loaded = e.load_cache(snap)
        out["load_runtime"] = {"seconds": time.perf_counter() - t, **loaded}
    mib = out["save"]["bytes"] / 2**20
    out["mib"] = mib
    out["met"] = (out["save"]["seconds"] < 2 and out["load_startup"]["seconds"] < 2
                  and out["load_runtime"]["seconds"] < 2)
    return out


# ------------------------------------------------------------------------------------------ report
def report(data: dict) -> str:
    lines = [f"model {data['model']}, {data['environment']['cpu_count']} CPUs, torch threads "
             f"{data['environment']['torch_threads']}, load average {data['environment']['loadavg']}"]
    if "ttft" in data:
        t = data["ttft"]
        lines.append(f"ttft  first request after a restart, {t['prompt_tokens']}-token prompt: cold "
                     f"{statistics.median(t['cold_s']):.3f} s, restored {statistics.median(t['restored_s']):.3f} s "
                     f"(cached {min(t['cached_tokens'])}) -> {t['ratio']:.3f}x cold "
                     f"(target <= 0.2: {'met' if t['met'] else 'NOT met'})")
    if "io" in data:
        io = data["io"]
        lines.append(f"io    {io['save']['tokens']} tokens, {io['mib']:.0f} MiB: save {io['save']['seconds']:.2f} s, "
                     f"load at start-up {io['load_startup']['seconds']:.2f} s, load at run time "
                     f"{io['load_runtime']['seconds']:.2f} s (target < 2 s each: {'met' if io['met'] else 'NOT met'})")
        tp = io.get("throughput")
        if tp:
            gaps = lambda w: max(r["max_gap_s"] for r in tp["runs"] if r["with_save"] == w)  # noqa: E731
            lines.append(f"tput  decode tok/s without a save {tp['without_mean']:.1f} (runs {tp['without_min']:.1f}-"
                         f"{tp['without_max']:.1f}), while saving {tp['with_save_mean']:.1f} "
                         f"({tp['ratio']:.3f}x); longest token gap {gaps(False) * 1000:.0f} ms without, "
                         f"{gaps(True) * 1000:.0f} ms while saving")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--system-tokens", type=int, default=1700)
    p.add_argument("--cache-tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=0, help="torch threads of the Engines (0: torch's default)")
    p.add_argument("--only", default="ttft,io,throughput")
    p.add_argument("--json", default="benchmarks/results/cache_snapshot.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from radixlm.runtime.executor.loader import load_tokenizer, resolve_model

    only = set(args.only.split(","))
    tokenizer = load_tokenizer(resolve_model(args.model).folder)
    given = sys.argv[1:] if argv is None else argv
    environment = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                   "loadavg": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
                   "torch": torch.__version__}
    data: dict = {"command": "python benchmarks/cache_snapshot.py " + " ".join(map(shlex.quote, given)),
                  "model": args.model, "environment": environment}
    with tempfile.TemporaryDirectory(prefix="radixlm-snapbench-") as tmp:
        if "ttft" in only:
            data["ttft"] = bench_ttft(args, tokenizer, Path(tmp))
        if only & {"io", "throughput"}:
            data["io"] = bench_io_and_throughput(args, tokenizer, Path(tmp), only)
    print(report(data))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return data


if __name__ == "__main__":
    main()
