"""How long the model's thread waits between two decode forwards, in-process, and on what.

    python benchmarks/step_gap.py [--model smollm2-135m] [--quantization int8] [--enable-torch-compile]
        [--requests 6] [--max-new-tokens 128] [--disable-overlap-schedule] [--batch 1]
        [--stub-sleep-ms MS] [--timeline]

An Engine runs `--requests` rounds of `--batch` greedy requests (new prompts each round, after one
warm-up request); `ModelRunner.forward` is stamped before and after every decode forward. Per round it
prints the median forward, the median period (one forward's start to the next one's) and the median
gap between them: the time the model's thread spends on anything else (sampling, taking the next
launch, waiting for the GIL). Tokens per second per request are 1 / period.

`--stub-sleep-ms` replaces the forward with host_overhead.py's stub (precomputed logits, a sleep with
the GIL released), as that benchmark's sleeping rows do. `--timeline` also stamps both ends of the
calls a decode step is made of, on whichever thread runs them: the forward, sampling
(`sample_on_device`), the next step's inputs (`follow_inputs`), and the scheduler's `resolve`,
`schedule` and overlap plan (`next_decode`). For each thread (the model's, the scheduler's) it prints
the median time from each stamp to the thread's next one (`sample> -> inputs<` on the model's thread:
from the end of a step's sampling to the start of the next step's inputs; `inputs< -> inputs>`
includes waiting for the GIL), over every round: where a step's time goes, one call at a time.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm  # noqa: E402

import radixlm.runtime.scheduler.scheduler as scheduler_module  # noqa: E402
from radixlm.runtime import Engine  # noqa: E402
from radixlm.runtime.executor.forward_batch import ForwardMode  # noqa: E402


class Timeline:
    """Stamps `name<` and `name>` around calls, with the thread that made them (appends from several
    threads: the GIL keeps each one whole)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, float]] = []
        self.gaps: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._wrapped: list[tuple[object, str, object]] = []

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        self._wrapped.append((owner, attr, original))

        def stamped(*args, **kwargs):
            thread = threading.current_thread().name
            self.events.append((thread, name + "<", time.perf_counter()))
            try:
                return original(*args, **kwargs)
            finally:
                self.events.append((thread, name + ">", time.perf_counter()))

        setattr(owner, attr, stamped)

    def unwrap(self) -> None:
        """Puts the originals back (the scheduler module's functions outlive this run's Engine)."""
        for owner, attr, original in reversed(self._wrapped):
            setattr(owner, attr, original)
        self._wrapped = []

    def collect(self) -> None:
        """Moves the round's intervals (between consecutive stamps of one thread) into `gaps`."""
        last: dict[str, tuple[str, float]] = {}
        for thread, name, t in self.events:
            if thread in last:
                before, t0 = last[thread]
                self.gaps[(_role(thread), f"{before} -> {name}")].append((t - t0) * 1e6)
            last[thread] = (name, t)
        self.events = []

    def table(self, min_count: int) -> list[dict]:
        rows = [{"thread": th, "from_to": k, "count": len(v), "median_us": statistics.median(v)}
                for (th, k), v in self.gaps.items() if len(v) >= min_count]
        return sorted(rows, key=lambda r: (r["thread"], -r["count"], r["from_to"]))


def _host_overhead():
    """benchmarks/host_overhead.py (its stub), loaded by path: benchmarks are scripts, not a package, and
    this module may run inside another process (the tests) whose import path should stay as it is."""
    name = "radixlm_bench_host_overhead"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name("host_overhead.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # registered first: its dataclasses look their module up
    return sys.modules[name]


def _role(thread_name: str) -> str:
    return "model" if thread_name.startswith("radixlm-compute") else "scheduler"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--requests", type=int, default=6, help="rounds")
    p.add_argument("--batch", type=int, default=1, help="requests per round, sent at once")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stub-sleep-ms", type=float, default=None, help="host_overhead.py's stub instead of the model")
    p.add_argument("--timeline", action="store_true", help="stamp the calls of a step too")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    engine = Engine(model=args.model, quantization=args.quantization, log_level="warning",
                    enable_torch_compile=args.enable_torch_compile,
                    disable_overlap_schedule=args.disable_overlap_schedule,
                    max_running_requests=max(64, args.batch))
    if args.stub_sleep_ms is not None:
        stub = _host_overhead().StubForward(engine.runner)
        stub.sleep_s = args.stub_sleep_ms / 1e3
        engine.runner.forward = stub
    timeline = Timeline()
    stamps: list[tuple[float, float]] = []
    forward = engine.runner.forward

    def stamped(batch):
        start = time.perf_counter()
        out = forward(batch)
        if batch.mode is ForwardMode.DECODE and batch.batch_size == args.batch:
            stamps.append((start, time.perf_counter()))
        return out

    engine.runner.forward = stamped
    if args.timeline:
        sched = engine.scheduler
        timeline.wrap(engine.runner, "forward", "forward")
        timeline.wrap(scheduler_module, "sample_on_device", "sample")
        timeline.wrap(scheduler_module, "follow_inputs", "inputs")
        timeline.wrap(sched, "resolve", "resolve")
        timeline.wrap(sched, "schedule", "schedule")
        if sched.overlap is not None:
            timeline.wrap(sched.overlap, "next_decode", "plan")
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    rows = []
    try:
        engine.generate("A warm-up request.", params)
        for i in tqdm(range(args.requests), desc="rounds", disable=args.no_progress):
            stamps.clear()
            timeline.events = []
            prompts = [f"Story number {i}.{j}: once upon a time, in a land far away," for j in range(args.batch)]
            engine.generate(prompts if args.batch > 1 else prompts[0], params)
            timeline.collect()
            fwd = statistics.median(b - a for a, b in stamps)
            period = statistics.median(c[0] - a[0] for a, c in zip(stamps, stamps[1:]))
            gap = statistics.median(c[0] - b for (_, b), c in zip(stamps, stamps[1:]))
            rows.append({"forward_ms": fwd * 1e3, "period_ms": period * 1e3, "gap_ms": gap * 1e3,
                         "tok_s": 1 / period, "decode_steps": len(stamps)})
    finally:
        timeline.unwrap()
        engine.shutdown()
    print("\n| round | forward (ms) | period (ms) | gap (ms) | tok/s per request |\n|--:|--:|--:|--:|--:|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['forward_ms']:.2f} | {r['period_ms']:.2f} | {r['gap_ms']:.2f} | {r['tok_s']:.1f} |")
    steps = sum(r["decode_steps"] for r in rows)
    calls = timeline.table(min_count=max(1, steps // 2)) if args.timeline else []
    if calls:
        print("\n| thread | from -> to | count | median (us) |\n|---|---|--:|--:|")
        for c in calls:
            print(f"| {c['thread']} | {c['from_to']} | {c['count']} | {c['median_us']:.0f} |")
    return {"rounds": rows, "timeline": calls}


if __name__ == "__main__":
    main()
