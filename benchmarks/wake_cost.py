"""What a thread pays to run the same sampling call right after it slept: the floor under
host_overhead.py's sleeping stub on this machine.

    python benchmarks/wake_cost.py [--batches 1,8,64] [--sleep-ms 3] [--calls 100] [--rounds 2]
        [--vocab 49152] [--threads 0] [--json PATH] [--no-progress]

The sleeping stub stands in for a device: the model's thread sleeps `--sleep-ms` with the GIL
released, then samples the step's logits (a greedy batch: the chunked argmax of
`runtime/sampling/kernels.py`) and takes the next launch. host_overhead.py charges that whole
sleep-to-launch stretch to the step. This script times the one `sample` call alone, on one thread,
in three situations, alternated `--rounds` times (medians over `--calls` calls each):

    hot    back to back: what the free stub sees
    sleep  after `--sleep-ms` of sleep (the timer slack at 1 ns, as the stub sets it)
    spin   after `--sleep-ms` of a Python busy loop (no memory traffic, the thread kept running)

`sleep - hot` is what waking up costs the step (caches, clocks, the hypervisor rescheduling a
virtual CPU); it is no work of ours, and on a GPU the argmax it slows down runs on the device.
Every timed call's ids are checked against torch.argmax, so the call measured is the real one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from host_overhead import exact_sleeps  # noqa: E402 (the stub's sleeps: the timer slack at 1 ns)
from tqdm import tqdm  # noqa: E402

from radixlm.runtime.request.params import SamplingParams  # noqa: E402
from radixlm.runtime.sampling.kernels import SamplingBatch, sample  # noqa: E402

MODES = ("hot", "sleep", "spin")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def greedy_call(batch: int, vocab: int, seed: int = 0):
    """The sampling call of a greedy decode step of `batch` rows, and the ids it must give."""
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed))
    params = [SamplingParams(temperature=0.0, max_new_tokens=100)] * batch
    state = SamplingBatch.build(params, [[1]] * batch, [[2]] * batch, vocab, logits.device)
    expected = logits.argmax(dim=-1)

    def call() -> torch.Tensor:
        return sample(logits, state, None, [0] * batch, logprob_rows=[]).next_token_ids

    return call, expected


def time_mode(call, expected: torch.Tensor, mode: str, sleep_s: float, calls: int) -> float:
    """Median microseconds of `call` in `mode`; raises if a call's ids are not torch.argmax's."""
    took = []
    for _ in range(calls):
        if mode == "sleep":
            time.sleep(sleep_s)
        elif mode == "spin":
            spin(sleep_s)
        t0 = time.perf_counter()
        ids = call()
        took.append((time.perf_counter() - t0) * 1e6)
        if not torch.equal(ids, expected):
            raise AssertionError(f"{mode}: sampled ids differ from torch.argmax")
    return statistics.median(took)


def measure(batches: list[int], sleep_ms: float, calls: int, rounds: int, vocab: int, progress: bool) -> list[dict]:
    rows: list[dict] = []
    error: list[BaseException] = []
    bar = tqdm(total=len(batches) * rounds * len(MODES), desc="wake cost", disable=not progress)

    def body() -> None:  # a thread of its own, as the model's thread is one
        try:
            exact_sleeps()
            for b in batches:
                call, expected = greedy_call(b, vocab)
                got: dict[str, list[float]] = {m: [] for m in MODES}
                for _ in range(rounds):
                    for mode in MODES:
                        got[mode].append(time_mode(call, expected, mode, sleep_ms / 1e3, calls))
                        bar.update()
                rows.append({"batch": b, **{f"{m}_us": got[m] for m in MODES}})
        except BaseException as e:  # re-raised on the caller's thread
            error.append(e)

    worker = threading.Thread(target=body, name="model")
    worker.start()
    worker.join()
    bar.close()
    if error:
        raise error[0]
    return rows


def markdown(rows: list[dict], sleep_ms: float) -> str:
    lines = [f"| batch | hot (us) | after {sleep_ms:g} ms asleep (us) | after {sleep_ms:g} ms spinning (us) | "
             "asleep - hot (us) |", "|--:|--:|--:|--:|--:|"]
    for r in rows:
        hot, asleep = statistics.median(r["hot_us"]), statistics.median(r["sleep_us"])
        cells = [" / ".join(f"{x:.0f}" for x in r[f"{m}_us"]) for m in MODES]
        lines.append(f"| {r['batch']} | {' | '.join(cells)} | {asleep - hot:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--sleep-ms", type=float, default=3.0)
    p.add_argument("--calls", type=int, default=100, help="timed calls per (batch, mode, round)")
    p.add_argument("--rounds", type=int, default=2, help="times the three modes are alternated")
    p.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary by default")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1 or args.calls < 1 or args.rounds < 1 or args.sleep_ms <= 0:
        p.error("batches, --calls and --rounds must be >= 1, --sleep-ms > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = measure(batches, args.sleep_ms, args.calls, args.rounds, args.vocab, not args.no_progress)
    print()
    print(markdown(rows, args.sleep_ms))
    print(f"\ntorch {torch.__version__} ({torch.get_num_threads()} threads), vocabulary {args.vocab}, "
          f"medians of {args.calls} calls per cell, {args.rounds} alternated rounds (shown in order)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sleep_ms": args.sleep_ms, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
