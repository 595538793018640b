"""How long the model's thread waits between two decode forwards, one client, in-process.

    python benchmarks/step_gap.py [--model smollm2-135m] [--quantization int8] [--enable-torch-compile]
        [--requests 6] [--max-new-tokens 128] [--disable-overlap-schedule]

An Engine runs `--requests` greedy requests one after another (a new prompt each, after one warm-up
request); `ModelRunner.forward` is stamped before and after every decode forward. Per request it
prints the median forward, the median period (one forward's start to the next one's) and the median
gap between them: the time the model's thread spends on anything else (sampling, taking the next
launch, waiting for the GIL). Tokens per second in-process are 1 / period.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tqdm import tqdm  # noqa: E402

from radixlm.runtime import Engine  # noqa: E402
from radixlm.runtime.executor.forward_batch import ForwardMode  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()

    engine = Engine(model=args.model, quantization=args.quantization, log_level="warning",
                    enable_torch_compile=args.enable_torch_compile,
                    disable_overlap_schedule=args.disable_overlap_schedule)
    stamps: list[tuple[float, float]] = []
    forward = engine.runner.forward

    def stamped(batch):
        start = time.perf_counter()
        out = forward(batch)
        if batch.mode is ForwardMode.DECODE:
            stamps.append((start, time.perf_counter()))
        return out

    engine.runner.forward = stamped
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    rows = []
    try:
        engine.generate("A warm-up request.", params)
        for i in tqdm(range(args.requests), desc="requests"):
            stamps.clear()
            engine.generate(f"Story number {i}: once upon a time, in a land far away,", params)
            fwd = statistics.median(b - a for a, b in stamps)
            period = statistics.median(c[0] - a[0] for a, c in zip(stamps, stamps[1:]))
            gap = statistics.median(c[0] - b for (_, b), c in zip(stamps, stamps[1:]))
            rows.append((fwd, period, gap))
    finally:
        engine.shutdown()
    print("\n| request | forward (ms) | period (ms) | gap (ms) | tok/s |\n|--:|--:|--:|--:|--:|")
    for i, (fwd, period, gap) in enumerate(rows):
        print(f"| {i} | {fwd * 1e3:.2f} | {period * 1e3:.2f} | {gap * 1e3:.2f} | {1 / period:.1f} |")


if __name__ == "__main__":
    main()
