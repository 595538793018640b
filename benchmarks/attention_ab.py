"""This tree's batch-invariant attention backend against another revision's, alternated in one process.

    python benchmarks/attention_ab.py REV [--tokens 1741] [--rounds 12]
    python benchmarks/attention_ab.py REV --decode [--context 40] [--enable-torch-compile] [--rounds 15]

On a shared VM whose speed drifts by a third within minutes, separate processes cannot tell a few
percent apart; two backends taking turns in one process, on the same inputs, can. `invariant_backend.py`
(and `invariant_decode.py` and `decode_kv.py`, where REV has them) are read from git at REV and loaded
beside this tree's; everything they import otherwise is this tree's. Both backends must give the same bits first.

- default: one layer of an extend of `--tokens` new tokens (random K/V in a pool, slots scattered,
  SmolLM2's head shape), best of 3 per round;
- `--decode`: the int8 model's decode step at `--context` tokens (`decode_split.py`'s batch), replayed
  on the runner's compute thread, the backend object's class swapped each round, median of 20 per round.

Prints each backend's median over the rounds and this tree's time over REV's per round.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from radixlm.runtime.executor.attention import invariant_backend  # noqa: E402
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardBatch, ForwardMode  # noqa: E402
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "runtime/executor/attention"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def load_revision(rev: str):
    """REV's invariant backend module (with REV's decode module, where it has one)."""

    def show(name: str) -> str | None:
        got = subprocess.run(["git", "show", f"{rev}:{FOLDER}/{name}"], cwd=ROOT, capture_output=True, text=True)
        return got.stdout if got.returncode == 0 else None

    def load(name: str, source: str):
        spec = importlib.util.spec_from_loader(name, loader=None)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        exec(compile(source, f"{rev}:{name}", "exec"), module.__dict__)
        return module

    backend = show("invariant_backend.py")
    if backend is None:
        raise SystemExit(f"{rev} has no {FOLDER}/invariant_backend.py")
    decode = show("invariant_decode.py")
    if decode is not None:
        load("ab_rev_invariant_decode", decode)
        backend = backend.replace("radixlm.runtime.executor.attention.invariant_decode", "ab_rev_invariant_decode")
    kept = show("decode_kv.py")
    if kept is not None:  # its kept K/V as REV keeps them (the probe and this tree's modules keep this tree's)
        load("ab_rev_decode_kv", kept)
        backend = backend.replace("from radixlm.runtime.executor.attention import decode_kv",
                                  "import ab_rev_decode_kv as decode_kv")
    return load("ab_rev_invariant_backend", backend)


def extend_case(tokens: int):
    """A pool holding one request's `tokens` keys in scattered slots, and a function running one layer
    of its whole prefill through a backend."""
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(tokens + 8, 1, KV_HEADS, HEAD_DIM, torch.float32, torch.device("cpu"))
    for t in (pool.k[0], pool.v[0]):
        t.copy_(torch.randn(t.shape, generator=gen))
    table = ReqToTokenPool(2, tokens + 1, torch.device("cpu"))
    row = table.alloc()
    slots = torch.randperm(tokens, generator=gen)
    table.write(row, 0, slots)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    k, v = pool.k[0][slots].clone(), pool.v[0][slots].clone()

    def run(backend) -> torch.Tensor:
        batch = ForwardBatch.build(BatchPlan(ForwardMode.EXTEND, [0] * tokens, slots, [row], [0], [tokens],
                                             list(range(tokens))), table, pool, torch.device("cpu"))
        backend.init_forward_metadata(batch)
        return backend.forward(q, k, v, 0, batch)

    return run


def alternate(rounds: int, measure, names=("this tree", "rev")) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(measure(name))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rev", help="a git revision to compare with (e.g. HEAD~1)")
    p.add_argument("--decode", action="store_true", help="the int8 model's decode step instead of an extend layer")
    p.add_argument("--tokens", type=int, default=1741)
    p.add_argument("--context", type=int, default=40)
    p.add_argument("--enable-torch-compile", action="store_true")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rev = load_revision(args.rev)

    if not args.decode:
        run = extend_case(args.tokens)
        backends = {"this tree": invariant_backend.InvariantAttentionBackend(HEADS, KV_HEADS, HEAD_DIM),
                    "rev": rev.InvariantAttentionBackend(HEADS, KV_HEADS, HEAD_DIM)}
        if not torch.equal(run(backends["this tree"]), run(backends["rev"])):
            raise SystemExit("the two backends give different bits")

        def measure(name: str) -> float:
            best = []
            for _ in range(3):
                start = time.perf_counter()
                run(backends[name])
                best.append(time.perf_counter() - start)
            return min(best) * 1e3

        times = alternate(args.rounds, measure)
        what = f"one layer of a {args.tokens}-token extend"
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from decode_split import last_decode_batch

        from radixlm.runtime import Engine

        engine = Engine(model="smollm2-135m", quantization="int8", log_level="warning", disable_overlap_schedule=True,
                        enable_torch_compile=args.enable_torch_compile)
        runner = engine.runner
        batch = last_decode_batch(engine, args.context)
        attn = runner.model.layers[0].self_attn.attn  # one backend object serves every layer
        classes = {"this tree": type(attn), "rev": rev.InvariantAttentionBackend}

        def step(name: str):
            if type(attn) is not classes[name]:
                attn.__class__ = classes[name]
                attn._own_kv = attn._shared_kv = None  # kept K/V start over with the other class's plan
            return runner.forward(batch)  # replays after the first reuse the kept K/V, as decodes in a row do

        def replay() -> dict[str, list[float]]:
            if not torch.equal(step("this tree"), step("rev")):
                raise SystemExit("the two backends give different logits")

            def measure(name: str) -> float:
                for _ in range(3):
                    step(name)
                took = []
                for _ in range(20):
                    start = time.perf_counter()
                    step(name)
                    took.append(time.perf_counter() - start)
                return statistics.median(took) * 1e3

            try:
                return alternate(args.rounds, measure)
            finally:
                attn.__class__ = classes["this tree"]

        times = runner.compute.run(replay)
        engine.shutdown()
        what = f"an int8 decode step at {args.context} tokens" + (", compiled" if args.enable_torch_compile else "")

    print(f"\n{what}, {args.threads} thread(s), {args.rounds} alternated rounds (ms):")
    for name, got in times.items():
        print(f"  {name}: median {statistics.median(got):.2f}  ({', '.join(f'{x:.2f}' for x in got)})")
    ratios = [a / b for a, b in zip(times["this tree"], times["rev"])]
    shown = ", ".join(f"{x:.3f}" for x in ratios)
    print(f"  this tree / {args.rev}: median {statistics.median(ratios):.3f}  ({shown})")


if __name__ == "__main__":
    main()
