"""The CPU runtime beside another busy process: one client's decode and a small batch, quiet and
with a process spinning on a core, with the thread governor (runtime/executor/cpu/contention.py)
and without it (`RADIXLM_THREAD_GOVERNOR=off`).

    python benchmarks/contention.py [--spinners 1] [--tokens 96] [--rounds 3] [--model smollm2-135m]
        [--json benchmarks/results/contention.json]

Each (governor, load) pair runs in a fresh process, alternating, `--rounds` times; a figure is the
median. The spinners are `python -c "while True: pass"`, started before the measured process and
killed after it. The ratio that matters is busy / quiet for each setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

CHILD = r"""
import json, sys, time
from radixlm.runtime import Engine
model, tokens = sys.argv[1], int(sys.argv[2])
e = Engine(model=model, log_level="warning")
p = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
prompt = "Write a long story about a lighthouse keeper and a storm."
e.generate(prompt, {**p, "max_new_tokens": 8})
time.sleep(1.2)  # the governor reads the load over its interval before the timed part
t = time.perf_counter(); e.generate(prompt, p); decode = tokens / (time.perf_counter() - t)
batch = [f"{i}. Tell me about the number {i} and its history, in many words. " * 5 for i in range(8)]
t = time.perf_counter(); e.generate(batch, {**p, "max_new_tokens": 16}); batch_s = time.perf_counter() - t
print(json.dumps({"decode_tok_s": decode, "batch_s": batch_s}))
e.shutdown()
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spinners", type=int, default=1, help="busy processes beside the busy runs")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="benchmarks/results/contention.json")
    return p.parse_args(argv)


def run_once(args: argparse.Namespace, governor: bool, busy: bool) -> dict:
    env = {**os.environ, "RADIXLM_THREAD_GOVERNOR": "on" if governor else "off", "HF_HUB_OFFLINE": "1"}
    spin = [sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(spin) for _ in range(args.spinners if busy else 0)]
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.tokens)], env=env, check=True,
                             capture_output=True, text=True, timeout=900)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cases = [(g, b) for g in (True, False) for b in (False, True)]
    results: dict = {case: [] for case in cases}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for case in cases:
            results[case].append(run_once(args, *case))
            time.sleep(1)
    rows = {}
    for governor in (True, False):
        quiet, busy = results[(governor, False)], results[(governor, True)]
        med = {k: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for k, runs in
               (("quiet", quiet), ("busy", busy))}
        rows["governor" if governor else "fixed threads"] = med
    print(f"\n{args.spinners} spinning process(es) beside the busy runs; medians of {args.rounds} rounds, "
          f"{os.cpu_count()} CPUs\n")
    print("| threads | decode quiet / busy (tok/s) | busy / quiet | 8-prompt batch quiet / busy (s) | quiet / busy |")
    print("|---|--:|--:|--:|--:|")
    for name, m in rows.items():
        q, b = m["quiet"], m["busy"]
        decode = f"{q['decode_tok_s']:.1f} / {b['decode_tok_s']:.1f} | {b['decode_tok_s'] / q['decode_tok_s']:.2f}x"
        print(f"| {name} | {decode} | {q['batch_s']:.2f} / {b['batch_s']:.2f} | {q['batch_s'] / b['batch_s']:.2f}x |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "spinners": args.spinners,
                                               "rows": rows}, indent=2))
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
