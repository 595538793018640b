"""Workloads and measurements of ``benchmarks/gpu.py``: the sizes, the prompts, decode rates by
difference, the GPU's busy share from torch.profiler, and the device-to-device copy bandwidth.

Engines and transformers are driven through ``offline_systems`` (EngineSystem, HFSystem), the JSON
rows through ``constrained.py``'s ``speed_runs``: every system here runs exactly as in those
benchmarks, only the workloads differ.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch
import workloads as wl
from offline_systems import RunResult, tokenize
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
QUIET = tqdm(disable=True)  # the systems' per-request progress is not shown


@dataclass(frozen=True, slots=True)
class Sizes:
    """The issue's sizes at scale 1. ``scaled`` shrinks token counts (lengths, new tokens, the copy),
    never batch sizes, so every row keeps its batch shape on a CPU."""

    prompt: int = 256  # decode rows: prompt tokens
    new: int = 128  # decode rows and the busy-share run: new tokens per request
    batches: tuple[int, ...] = (1, 64)  # decode rows (the largest is also the busy-share run)
    prefill_reqs: int = 16
    prefill_len: int = 2048
    few_shot_reqs: int = 64
    few_shot_prefix: int = 1500
    few_shot_new: int = 16
    json_batch: int = 32
    json_new: int = 128
    copy_bytes: int = 2**30

    def scaled(self, scale: float) -> Sizes:
        if scale == 1:
            return self

        def f(x: int, low: int) -> int:
            return max(low, round(x * scale))

        return replace(self, prompt=f(self.prompt, 8), new=f(self.new, 32), prefill_len=f(self.prefill_len, 32),
                       few_shot_prefix=f(self.few_shot_prefix, 32), few_shot_new=f(self.few_shot_new, 4),
                       json_new=f(self.json_new, 16), copy_bytes=f(self.copy_bytes, 2**24))

    def pool_tokens(self) -> int:
        """A KV pool that holds the largest workload at once (few-shot without the cache), plus a quarter."""
        need = max(self.few_shot_reqs * (self.few_shot_prefix + 64 + self.few_shot_new),
                   self.prefill_reqs * (self.prefill_len + 1), max(self.batches) * (self.prompt + self.new),
                   self.json_batch * (self.json_new + 256))
        return math.ceil(need * 1.25 / 1024) * 1024

    def max_positions(self) -> int:
        return max(self.prefill_len, self.few_shot_prefix + 128, self.prompt + self.new, 512) + 64


# ------------------------------------------------------------------------------------------ workloads


def prompts_of(tok, n: int, length: int, seed: int) -> list[str]:
    """``n`` distinct prompts of about ``length`` tokens: seeded random words cut at ``length``
    tokens; they share nothing past the leading number."""
    rng = random.Random(f"gpu/{seed}")
    out = []
    for i in range(n):
        text = f"{i}. " + " ".join(rng.choice(wl.WORDS) for _ in range(length))
        out.append(tok.decode(tokenize(tok, text)[:length]))
    return out


def one_round(name: str, prompts: list[str], new: int) -> wl.Workload:
    reqs = [wl.Request(p, new, group=i, round=0) for i, p in enumerate(prompts)]
    return wl.Workload(name, f"{len(prompts)} prompts -> {new} new tokens", [reqs])


def timed(system, work: wl.Workload, repeats: int) -> RunResult:
    """The fastest of ``repeats`` runs after one untimed warm-up run (an Engine flushes its cache
    before every run: each run is cold)."""
    positions = {id(r): i for i, r in enumerate(work.requests)}
    system.run(work, positions, QUIET)
    return min((system.run(work, positions, QUIET) for _ in range(repeats)), key=lambda r: r.time_s)


def decode_rate(system, prompts: list[str], new: int, repeats: int) -> dict:
    """Decode tokens per second, the prefill cancelled out: ``batch * (new - 1) / (t(new) - t(1))``
    where ``t(n)`` is the wall time of a cold run generating ``n`` tokens per request."""
    full = timed(system, one_round("decode", prompts, new), repeats)
    first = timed(system, one_round("decode", prompts, 1), repeats)
    dt = full.time_s - first.time_s
    return {"batch": len(prompts), "prompt_tokens": full.prompt_tokens / len(prompts), "new_tokens": new,
            "time_s": full.time_s, "first_token_time_s": first.time_s,
            "tok_s": len(prompts) * (new - 1) / dt if dt > 0 else None,
            "end_to_end_tok_s": full.tok_s, "outputs": full.outputs}


def same_outputs(a: RunResult | dict, b: RunResult | dict) -> int:
    """How many requests got the same output ids in both runs."""
    x, y = (r.outputs if isinstance(r, RunResult) else r["outputs"] for r in (a, b))
    return sum(x[k] == y.get(k) for k in x)


# ------------------------------------------------------------------------------------------ the JSON row


def bench_constrained() -> ModuleType:
    """benchmarks/constrained.py, loaded by path: ``constrained`` is also the repo's constrained/ folder."""
    name = "bench_constrained"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / "constrained.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def json_vs_plain(engine, tok, batch: int, new: int, repeats: int) -> dict:
    """constrained.py's speed stage at one batch size: its JSON-extraction prompts and schema, then
    unconstrained decoding of exactly as many tokens per request on the same engine."""
    bc = bench_constrained()
    prompts = [tok.apply_chat_template([{"role": "user", "content": bc.JF_PROMPT.format(text=t)}], tokenize=False,
                                       add_generation_prompt=True) for t in bc.extraction_texts(batch, 0)]
    run = bc.speed_runs(engine, prompts, [json.dumps(bc.JF_SCHEMA)], new, {batch: batch}, repeats)[batch]
    js, plain = run["json"], run["plain"]
    return {"batch": batch, "max_new_tokens": new, "json_tok_s": js["tok_s"], "plain_tok_s": plain["tok_s"],
            "ratio": run["ratio"], "output_tokens": js["output_tokens"],
            "jump_forward_tokens": js["jump_forward_tokens"], "grammar_s": js["grammar_s"], "wall_s": js["wall_s"],
            "sample_s": js["sample_s"], "forward_passes": js["forward_passes"],
            "overlapped_steps": js["overlapped_steps"], "plain_wall_s": plain["wall_s"],
            "plain_forward_passes": plain["forward_passes"],
            "complete": sum(f == "stop" for f in js["finish"]),
            "valid": sum(f == "stop" and bc.validate(t, bc.JF_SCHEMA)[0] for f, t in zip(js["finish"], js["texts"]))}


# ------------------------------------------------------------------------------------------ the device


def covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` spans (overlapping kernels count once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def gpu_busy(engine, prompts: list[str], new: int, device: torch.device) -> dict:
    """How much of a batch decode run the GPU spends running something: the union of every device
    activity torch.profiler records (kernels, copies, memsets) over the run's wall time. The prompts
    are cached first, so the run is one one-token extend and then decode steps. A CPU has no device
    activity: the run is profiled all the same and the share is None (as on a GPU where the profiler
    recorded no device activity)."""
    from torch.profiler import DeviceType, ProfilerActivity, profile

    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    engine.generate(prompts, {**params, "max_new_tokens": 1})
    passes = engine.get_server_info()["forward_passes"]
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - t0
    steps = engine.get_server_info()["forward_passes"] - passes
    events = [e for e in prof.events() or [] if e.device_type == DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    busy = covered(spans) / 1e6 if spans else None  # the profiler's times are in microseconds
    return {"device": device.type, "batch": len(prompts), "forward_passes": steps, "wall_s": wall,
            "step_ms": wall / steps * 1e3, "device_events": len(spans), "busy_s": busy,
            "share": busy / wall if busy is not None else None,
            "kernels": top_kernels([(e.name, e.time_range.end - e.time_range.start) for e in events], steps),
            "gaps": idle_gaps(spans, steps)}


def host_syncs(engine, prompts: list[str], new: int, device: torch.device) -> dict:
    """Where a decode run blocks the host on the device: the run (prompts cached first, as in
    `gpu_busy`) under torch's sync debug mode, each synchronizing op counted by the Python line that
    called it. The one designed wait is the resolve's on its own step's copy (`copied.synchronize()` in
    sampling/step.py); on an overlapped decode any other site is a stall to remove. Only a GPU can
    run it: on a CPU sites is None."""
    if device.type != "cuda":
        return {"device": device.type, "batch": len(prompts), "sites": None}
    params = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    engine.generate(prompts, {**params, "max_new_tokens": 1})
    with warnings.catch_warnings(record=True) as caught:  # every thread's: the mode is process-wide too
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return {"device": device.type, "batch": len(prompts), "new_tokens": new, "sites": dict(sites.most_common(20))}


def top_kernels(timed: list[tuple[str, float]], steps: int, top: int = 10) -> list[dict]:
    """The device work that takes the most time, by name: calls and microseconds per step."""
    calls: dict[str, int] = {}
    total: dict[str, float] = {}
    for name, us in timed:
        calls[name] = calls.get(name, 0) + 1
        total[name] = total.get(name, 0.0) + us
    ranked = sorted(total, key=total.__getitem__, reverse=True)[:top]
    return [{"name": n[:120], "calls_per_step": calls[n] / max(steps, 1), "us_per_step": total[n] / max(steps, 1)}
            for n in ranked]


def idle_gaps(spans: list[tuple[float, float]], steps: int) -> dict:
    """Where the device idles between its first and last activity: the gaps between merged spans,
    split at 20 us (a launch's worth, scattered between kernels, against the host holding a step up)."""
    gaps, end = [], -math.inf
    for a, b in sorted(spans):
        if a > end and end != -math.inf:
            gaps.append(a - end)
        end = max(end, b)
    small = [g for g in gaps if g < 20.0]
    large = [g for g in gaps if g >= 20.0]
    per = max(steps, 1)
    return {"small_per_step": len(small) / per, "small_us_per_step": sum(small) / per,
            "large_per_step": len(large) / per, "large_us_per_step": sum(large) / per,
            "largest_us": sorted(large, reverse=True)[:5]}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves through memory (every byte read once and
    written once, so twice the bytes copied); the fastest of three timings of ``repeats`` copies."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(3):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes * repeats / best
