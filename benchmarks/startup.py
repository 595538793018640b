"""Server start-up: seconds from `python -m radixlm.server` to its first `/health` answer, and the CPU
each of its three processes spent getting there. Starts alternate across trees and modes.

    python benchmarks/startup.py [--quantization none,auto] [--rounds 3] [--tree NAME=DIR ...]
        [--model smollm2-135m] [--port 31050] [--json PATH]

`--tree NAME=DIR` runs the server from another checkout (e.g. a `git worktree` of an older commit,
put first on PYTHONPATH); the default is this checkout, named "this". Each round starts every
(tree, mode) pair once, in turn, so a slow spell of the machine hits them alike. A start is timed
from spawning the server to the first 200 from `/health` (polled every 50 ms); then the CPU seconds
of the HTTP process and of each child (utime + stime from /proc) are read, and the server is sent
SIGTERM. The scheduler log's "loaded ... in N s" is its model load (config, tokenizer, weights, fp16
packing, KV pool). Linux only (/proc). Prints a table of medians; `--json` keeps every start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("http", "scheduler", "detokenizer")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's helper process, which is neither the scheduler nor the detokenizer. A
    spawned child's name lives only inside Python; of the two children, the scheduler holds the model."""
    try:
        return b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # gone already: not one of the two


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def start_once(tree: Path, mode: str, model: str, port: int, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               HF_HUB_OFFLINE="1")
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "radixlm.server", "--model", model, "--quantization", mode,
                                 "--port", str(port), "--log-level", "info"], cwd=tree, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/health"
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {Path(log.name).read_text()[-2000:]}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"no /health answer in {timeout:.0f}s")
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        kids = [(pid, cpu_seconds(pid), rss_mib(pid)) for pid in children(proc.pid) if not is_resource_tracker(pid)]
        kids.sort(key=lambda k: -k[2])  # the scheduler holds the model
        cpu = {"http": cpu_seconds(proc.pid)}
        for name, (_, seconds, _) in zip(("scheduler", "detokenizer"), kids, strict=False):
            cpu[name] = seconds
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = Path(log.name).read_text()
    os.unlink(log.name)
    loaded = re.search(r"INFO loaded .*?, ([0-9.]+)s\n", text)
    return {"wall_s": wall, "cpu_s": cpu, "load_s": float(loaded.group(1)) if loaded else None}


def summarize(starts: list[dict]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {"starts": len(starts), "wall_s": med([s["wall_s"] for s in starts]),
            "wall_range": (min(s["wall_s"] for s in starts), max(s["wall_s"] for s in starts)),
            "load_s": med([s["load_s"] for s in starts]),
            "cpu_s": {r: med([s["cpu_s"].get(r) for s in starts]) for r in ROLES}}


def table(results: dict[tuple[str, str], dict]) -> str:
    lines = ["| tree | mode | to /health (s, median) | range | scheduler's load (s) | CPU s: http / scheduler / "
             "detokenizer |", "|---|---|--:|--:|--:|--:|"]
    for (tree, mode), s in results.items():
        cpu = " / ".join("-" if s["cpu_s"][r] is None else f"{s['cpu_s'][r]:.1f}" for r in ROLES)
        load = "-" if s["load_s"] is None else f"{s['load_s']:.1f}"
        lines.append(f"| {tree} | {mode} | {s['wall_s']:.2f} | {s['wall_range'][0]:.2f}-{s['wall_range'][1]:.2f} | "
                     f"{load} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantization", default="none,auto", help="comma-separated modes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR: a checkout to start the server from")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--port", type=int, default=31050)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="write every start here")
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(REPO)}
    modes = [m for m in args.quantization.split(",") if m]
    runs: dict[tuple[str, str], list[dict]] = {(t, m): [] for t in trees for m in modes}
    with tqdm(total=args.rounds * len(runs), desc="server starts") as bar:
        for _ in range(args.rounds):
            for (tree, mode), starts in runs.items():
                bar.set_postfix_str(f"{tree} {mode}")
                starts.append(start_once(Path(trees[tree]).resolve(), mode, args.model, args.port, args.timeout))
                bar.update()
    results = {key: summarize(starts) for key, starts in runs.items()}
    print(f"\n{table(results)}\n\n{os.cpu_count()} CPUs; model {args.model}; {args.rounds} round(s), starts alternated")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{t} {m}": {"summary": results[(t, m)], "starts": runs[(t, m)]}
                                               for t, m in runs}, indent=1))
    return results


if __name__ == "__main__":
    main()
