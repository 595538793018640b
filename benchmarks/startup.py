"""Server start-up and memory: seconds from spawning a server to its first `/health` answer, the CPU
each of its processes spent getting there, and its memory once it has answered one request, against
llama.cpp's llama-server on the same GGUF. Starts alternate across trees, modes and servers.

    python benchmarks/startup.py [--quantization none,auto] [--rounds 3] [--tree NAME=DIR ...]
        [--llama-server PATH] [--model smollm2-135m] [--port 31050] [--cold] [--json PATH]

`--tree NAME=DIR` runs the server from another checkout (e.g. a `git worktree` of an older commit,
put first on PYTHONPATH); the default is this checkout, named "this". `--llama-server` (default
$LLAMA_SERVER, e.g. what `bash ../shared/peers/build_llama_server.sh` prints) adds llama-server
(`-t 2 -np 1 -c 8192 --no-repack`, as `one_client.py` runs it) on the model's GGUF. Each round starts
every (tree, mode) pair and llama-server once, in turn, so a slow spell of the machine hits them
alike. A start is timed from spawning the server to the first 200 from `/health` (polled every
50 ms); then the CPU seconds of each process (utime + stime from /proc) are read, one completion of
32 tokens is asked for, the memory of the server's processes is summed (proportional set size:
pages shared between them, such as torch's libraries, are counted once in all), and the server is
sent SIGTERM. The scheduler log's "loaded ... in N s" is its model load; its peak resident memory
(VmHWM) is read at /health. `--cold` gives each of our starts an empty model cache (RADIXLM_CACHE_DIR),
so each converts the GGUF as a first start does. Linux only (/proc). Prints a table of medians;
`--json` keeps every start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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


def pss_mib(pid: int) -> float:
    """The process's proportional set size: its private pages, and its share of pages it maps with others."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def peak_mib(pid: int) -> float:
    """The process's peak resident set (VmHWM)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return 0.0


def one_completion(port: int) -> None:
    body = json.dumps({"model": "m", "prompt": "The lighthouse keeper", "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        json.load(r)


def ours(tree: Path, mode: str, model: str, port: int, cache_dir: str | None = None) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               HF_HUB_OFFLINE="1")
    if cache_dir is not None:
        env["RADIXLM_CACHE_DIR"] = cache_dir
    return [sys.executable, "-m", "radixlm.server", "--model", model, "--quantization", mode, "--port", str(port),
            "--log-level", "info"], env


def llama(path: str, gguf: Path, port: int) -> tuple[list[str], dict]:
    return [path, "-m", str(gguf), "--port", str(port), "-t", "2", "-np", "1", "-c", "8192", "--no-repack"], \
        dict(os.environ)


def start_once(cmd: list[str], env: dict, cwd: Path, port: int, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        kids = [(pid, cpu_seconds(pid), pss_mib(pid)) for pid in children(proc.pid) if not is_resource_tracker(pid)]
        kids.sort(key=lambda k: -k[2])  # the scheduler holds the model
        peak = peak_mib(kids[0][0]) if kids else peak_mib(proc.pid)
        cpu = {"http": cpu_seconds(proc.pid)}
        for name, (_, seconds, _) in zip(("scheduler", "detokenizer"), kids, strict=False):
            cpu[name] = seconds
        one_completion(port)
        memory = sum(pss_mib(pid) for pid in [proc.pid, *children(proc.pid)])
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
    return {"wall_s": wall, "cpu_s": cpu, "load_s": float(loaded.group(1)) if loaded else None, "memory_mib": memory,
            "peak_mib": peak}


def summarize(starts: list[dict]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {"starts": len(starts), "wall_s": med([s["wall_s"] for s in starts]),
            "wall_range": (min(s["wall_s"] for s in starts), max(s["wall_s"] for s in starts)),
            "load_s": med([s["load_s"] for s in starts]), "memory_mib": med([s["memory_mib"] for s in starts]),
            "peak_mib": med([s["peak_mib"] for s in starts]),
            "cpu_s": {r: med([s["cpu_s"].get(r) for s in starts]) for r in ROLES}}


def table(results: dict[tuple[str, str], dict]) -> str:
    base = results.get(("llama-server", "-"))
    lines = ["| tree | mode | to /health (s, median) | range | scheduler's load (s) | CPU s: http / scheduler / "
             "detokenizer | memory after a request (MiB, PSS) | scheduler's peak (MiB) | / llama-server: start, "
             "memory |", "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for (tree, mode), s in results.items():
        cpu = " / ".join("-" if s["cpu_s"][r] is None else f"{s['cpu_s'][r]:.1f}" for r in ROLES)
        load = "-" if s["load_s"] is None else f"{s['load_s']:.1f}"
        ratio = f"{s['wall_s'] / base['wall_s']:.1f}x, {s['memory_mib'] / base['memory_mib']:.2f}x" if base else "-"
        lines.append(f"| {tree} | {mode} | {s['wall_s']:.2f} | {s['wall_range'][0]:.2f}-{s['wall_range'][1]:.2f} | "
                     f"{load} | {cpu} | {s['memory_mib']:.0f} | {s['peak_mib']:.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quantization", default="none,auto", help="comma-separated modes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tree", action="append", default=[], help="NAME=DIR: a checkout to start the server from")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama-server's path")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--port", type=int, default=31050)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--cold", action="store_true", help="an empty model cache for each of our starts")
    p.add_argument("--json", help="write every start here")
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(REPO)}
    modes = [m for m in args.quantization.split(",") if m]
    runs: dict[tuple[str, str], list[dict]] = {(t, m): [] for t in trees for m in modes}
    gguf = None
    if args.llama_server:
        sys.path.insert(0, str(REPO))
        from radixlm.runtime.executor.cpu.int4 import gguf_source
        from radixlm.runtime.executor.loader import resolve_model

        gguf = gguf_source(resolve_model(args.model).folder)
        if gguf is None:
            raise SystemExit(f"--llama-server: model {args.model} has no GGUF to serve")
        runs[("llama-server", "-")] = []
    with tqdm(total=args.rounds * len(runs), desc="server starts") as bar:
        for _ in range(args.rounds):
            for (tree, mode), starts in runs.items():
                bar.set_postfix_str(f"{tree} {mode}")
                if tree == "llama-server":
                    cmd, env, cwd = *llama(args.llama_server, gguf, args.port), REPO
                else:
                    cwd = Path(trees[tree]).resolve()
                    cold = tempfile.mkdtemp(prefix="radixlm-cold-") if args.cold else None
                    cmd, env = ours(cwd, mode, args.model, args.port, cold)
                try:
                    starts.append(start_once(cmd, env, cwd, args.port, args.timeout))
                finally:
                    if tree != "llama-server" and cold is not None:
                        shutil.rmtree(cold, ignore_errors=True)
                bar.update()
    results = {key: summarize(starts) for key, starts in runs.items()}
    print(f"\n{table(results)}\n\n{os.cpu_count()} CPUs; model {args.model}; {args.rounds} round(s), starts alternated")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{t} {m}": {"summary": results[(t, m)], "starts": runs[(t, m)]}
                                               for t, m in runs}, indent=1))
    return results


if __name__ == "__main__":
    main()
