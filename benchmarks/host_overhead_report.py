"""host_overhead.py's figures: per-step summaries, the table's rows and markdown, the run's environment."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path

import torch


def summary(runs: list[dict]) -> dict:
    wall = [x for r in runs for x in r["wall_ms"]]
    cpu = [x for r in runs for x in r["cpu_ms"]]
    calls = [x for r in runs for x in r["step_call_ms"]]
    slept = [x for r in runs for x in r["slept_ms"]]
    launch = [x for r in runs for x in r["launch_ms"]]
    if not wall:
        raise RuntimeError("no decode step ran at the full batch: raise --steps")
    return {
        "steps": len(wall),
        "median_ms": statistics.median(wall),
        "mean_ms": statistics.fmean(wall),
        "p90_ms": statistics.quantiles(wall, n=10)[-1] if len(wall) > 1 else wall[0],
        "cpu_median_ms": statistics.median(cpu),
        "cpu_mean_ms": statistics.fmean(cpu),
        "step_call_median_ms": statistics.median(calls) if calls else None,
        "slept_median_ms": statistics.median(slept) if slept else None,  # the sleep as it really took
        "launch_median_ms": statistics.median(launch) if launch else None,
    }


def row(overlap: str, batch: int, sleep_ms: float, free: dict, slept: dict, read_ms: float | None = None) -> dict:
    """`read_ms`: the batch's logits read once at this machine's memory speed (CPU only), so that a
    sleeping step cannot take less than sleep + read_ms when the sleep leaves them out of the caches."""
    host, step = free["median_ms"], slept["median_ms"]
    ideal, serial = max(host, sleep_ms), host + sleep_ms
    hideable = min(host, sleep_ms)
    # launch() beyond the forward (input copy, sampling: device work on a GPU, CPU time here) runs
    # on the forward thread under overlap: the host can hide its own work, not that
    launch = free["launch_median_ms"] or 0.0
    device = sleep_ms + launch
    return {
        "overlap": overlap, "batch": batch, "sleep_ms": sleep_ms, "steps": free["steps"],
        "host_ms": host, "host_cpu_ms": free["cpu_median_ms"], "step_ms": step,
        "ideal_ms": ideal, "serial_ms": serial, "launch_ms": launch,
        "step_over_device": step / device if device else None,
        "step_over_ideal": step / ideal if ideal else None,
        "hidden": (serial - step) / hideable if hideable > 0 else None,
        "logits_read_ms": read_ms,
        "read_floor_over_ideal": (sleep_ms + read_ms) / ideal if read_ms is not None and ideal else None,
        "free": free, "sleep": slept,
    }


def markdown(rows: list[dict], sleep_ms: float) -> str:
    lines = [
        f"| overlap | batch | decode steps | host (ms/step) | host CPU (ms/step) | step, sleep {sleep_ms:g} ms "
        "(ms) | max(host, sleep) | host + sleep | step / max | hidden | sleep took (ms) | host CPU, sleep run "
        "(ms/step) | launch, free (ms) | step / (sleep + launch) | logits read at memory speed (ms) | "
        "(sleep + read) / max |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        hidden = "—" if r["hidden"] is None else f"{r['hidden']:.0%}"
        slept = r["sleep"]["slept_median_ms"]
        lines.append(
            f"| {r['overlap']} | {r['batch']} | {r['steps']} | {r['host_ms']:.2f} | {r['host_cpu_ms']:.2f} | "
            f"{r['step_ms']:.2f} | {r['ideal_ms']:.2f} | {r['serial_ms']:.2f} | {r['step_over_ideal']:.2f}x | "
            f"{hidden} | {'—' if slept is None else f'{slept:.2f}'} | {r['sleep']['cpu_median_ms']:.2f} | "
            f"{r['launch_ms']:.2f} | {r['step_over_device']:.2f}x | {_or_dash(r['logits_read_ms'], '.2f')} | "
            f"{_or_dash(r['read_floor_over_ideal'], '.2f', 'x')} |"
        )
    return "\n".join(lines)


def _or_dash(value: float | None, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def environment(device: str, overlap: bool) -> dict:
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5,
                                  cwd=Path(__file__).resolve().parent).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "device": device, "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "git_commit": git("rev-parse", "HEAD") or None,
        "git_dirty": bool(status) if status is not None else None,
        "overlap_field": overlap,
    }
