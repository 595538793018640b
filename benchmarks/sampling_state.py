"""What the decode batch's sampling state costs when its rows change: rebuilt, or filtered and merged.

    python benchmarks/sampling_state.py [--rows 64] [--repeats 2000]

Host microseconds per `RunningSampling.for_rows` call (sampling/running.py) over `--rows` requests,
greedy and sampled (temperature 0.7, top_p 0.9), in four cases: the same rows as the last step
(reused), a fresh build (nothing kept), and alternating steps where the last row leaves and joins
again (one filter, then one merge). Median of 5 rounds of `--repeats` calls each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.request.req import Req
from radixlm.runtime.sampling.running import RunningSampling

VOCAB = 49152


def per_call_us(fn, repeats: int, calls_per_fn: int = 1) -> float:
    for _ in range(50):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - t0) / repeats / calls_per_fn * 1e6)
    return statistics.median(rounds)


def measure(n: int, params: dict, repeats: int) -> tuple[float, float, float]:
    """(same rows, fresh build, filter then merge) microseconds per call for n rows of `params`."""
    reqs = [Req(rid=str(i), input_ids=[1, 2, 3], params=SamplingParams(**params)) for i in range(n)]
    fewer = reqs[:-1]
    state = RunningSampling(VOCAB, torch.device("cpu"), eos_ids=[0])
    state.for_rows(reqs)
    same = per_call_us(lambda: state.for_rows(reqs), repeats)

    def fresh():
        state._batch = None  # nothing kept: the next call builds
        state.for_rows(reqs)

    build = per_call_us(fresh, repeats)
    changing = per_call_us(lambda: (state.for_rows(fewer), state.for_rows(reqs)), repeats, 2)
    return same, build, changing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2000)
    args = p.parse_args()
    print(f"| rows ({args.rows}) | same rows | fresh build | filter, then merge (per call) |\n|---|--:|--:|--:|")
    for label, params in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.7, "top_p": 0.9})):
        same, build, changing = measure(args.rows, params, args.repeats)
        print(f"| {label} | {same:.1f} us | {build:.1f} us | {changing:.1f} us |")


if __name__ == "__main__":
    main()
