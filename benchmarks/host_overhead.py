"""Host overhead per decode step: the real Engine with the model's forward replaced by a stub.

    python benchmarks/host_overhead.py [--batches 1,8,64] [--sleep-ms 3] [--steps 128] [--repeats 1]
        [--model tiny|smollm2-135m|PATH] [--device auto|cpu|cuda] [--threads 0] [--json PATH] [--profile]

Everything but the model runs for real: the driver loop, scheduling, `ForwardBatch.build`, sampling
(greedy over the real 49152-token vocabulary), finish checks, output delivery. `ModelRunner.forward`
is replaced by a stub that returns precomputed float32 logits of the right shape on the runner's
device, and either costs nothing ("free") or sleeps `--sleep-ms` with the GIL released ("sleep",
standing in for a GPU forward; the sleeping thread's timer slack is set to 1 ns, so the OS does not
wake it tens of microseconds late as it may a normal thread). Each batch size B runs B requests with
short distinct prompts, greedy, `ignore_eos`, `max_new_tokens = steps + 1`, submitted at once, so
after one prefill step every decode step runs at batch B.

Per-step figures count decode steps only: the stub stamps the wall clock and the process CPU
clock every time it is called, and a step is the interval from one decode forward at batch B to the
next (prefill steps and steps of a partial batch are left out). That interval is the whole period
of the loop (driver, schedule, forward, sample, process), and it stays meaningful when an overlap
scheduler runs the forward beside the host work.

    host     median step with the free stub (ms): the host work of one decode step
    step     median step with the sleeping stub
    ideal    max(host, sleep): a scheduler that hides host work completely behind the forward
    serial   host + sleep: no overlap at all
    hidden   (serial - step) / min(host, sleep): share of the hideable time that was hidden
    launch   median `Scheduler.launch` with the free stub: the input copy and sampling around the
             forward (greedy argmax over the vocabulary). On a GPU that is device work; here it is
             CPU time on the forward thread, which overlap cannot hide, so a sleeping step cannot
             beat sleep + launch: `step / (sleep + launch)` is how close overlap gets to that floor
    read     (CPU) the batch's logits (batch x vocab float32) read once at this machine's memory speed
             (a 256 MiB sum on the sampling thread): after a sleep that leaves them out of the caches,
             sampling reads at least that much, so `(sleep + read) / max` is the best a sleeping step
             can reach here, whatever the scheduler does

When `EngineArgs` has a `disable_overlap_schedule` field, every figure is taken with overlap on and
off (one Engine each); otherwise the report says "overlap: not available".

`--profile` runs the free stub at the largest batch once under cProfile (on the scheduler thread,
around every `Scheduler.step()` call) and prints the top 25 functions by cumulative time, then the
top 15 by own time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import dataclasses
import io
import json
import os
import pstats
import shlex
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from radixlm.runtime import Engine  # noqa: E402
from radixlm.runtime.engine_args import EngineArgs  # noqa: E402
from radixlm.runtime.executor.forward_batch import ForwardMode  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the report beside it, when loaded by path
from host_overhead_report import environment, markdown, row, summary  # noqa: E402

OVERLAP_FIELD = "disable_overlap_schedule"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
WORDS = ("river", "engine", "garden", "orbit", "lantern", "harbor", "violin", "meadow", "canyon", "pixel",
         "glacier", "thunder", "copper", "falcon", "marble", "prairie")


# ------------------------------------------------------------------------------------------ the stub


@dataclass(slots=True)
class Call:
    wall: float  # time.perf_counter() at entry
    cpu: float  # time.process_time() at entry (all threads of the process)
    decode: bool
    batch: int


class StubForward:
    """Stands in for `ModelRunner.forward`: precomputed logits [rows, vocab] on the runner's device."""

    def __init__(self, runner, seed: int = 0):
        self.vocab = runner.vocab_size
        self.device = runner.device
        self.seed = seed
        self.sleep_s = 0.0
        self.recording = False
        self.calls: list[Call] = []
        self.slept_ms: list[float] = []  # how long each sleep really took (the OS wakes the thread late)
        self._logits: dict[int, torch.Tensor] = {}

    def logits(self, rows: int) -> torch.Tensor:
        out = self._logits.get(rows)
        if out is None:
            gen = torch.Generator().manual_seed(self.seed + rows)
            out = torch.randn(rows, self.vocab, generator=gen, dtype=torch.float32).to(self.device)
            self._logits[rows] = out
        return out

    def __call__(self, batch) -> torch.Tensor:
        if self.recording:
            self.calls.append(Call(time.perf_counter(), time.process_time(), batch.mode is ForwardMode.DECODE,
                                   batch.batch_size))
        out = self.logits(int(batch.logits_indices.shape[0]))  # the shape is host metadata: no sync
        if self.sleep_s > 0:
            exact_sleeps()
            t0 = time.perf_counter()
            time.sleep(self.sleep_s)  # releases the GIL, like waiting on a device
            if self.recording:
                self.slept_ms.append((time.perf_counter() - t0) * 1e3)
        return out


_EXACT = threading.local()
PR_SET_TIMERSLACK = 29


def exact_sleeps() -> None:
    """The calling thread's sleeps end on time, as a device's forward does: Linux lets a sleeping
    thread's timer run late by its "timer slack" (50 us by default) to batch wake-ups, which made a
    3 ms sleep take 3.09-3.12 ms here. Set to 1 ns once per thread; elsewhere nothing changes."""
    if getattr(_EXACT, "done", False):
        return
    _EXACT.done = True
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)


def decode_steps(calls: list[Call], batch: int) -> tuple[list[float], list[float]]:
    """(wall ms, CPU ms) of every step from a decode forward at `batch` to the next one."""
    wall, cpu = [], []
    for a, b in zip(calls, calls[1:]):
        if a.decode and b.decode and a.batch == batch == b.batch:
            wall.append((b.wall - a.wall) * 1e3)
            cpu.append((b.cpu - a.cpu) * 1e3)
    return wall, cpu


# ------------------------------------------------------------------------------------------ engine


def overlap_available() -> bool:
    return OVERLAP_FIELD in {f.name for f in dataclasses.fields(EngineArgs)}


def overlap_modes() -> list[tuple[str, dict]]:
    """(label, extra Engine kwargs) for every overlap setting EngineArgs offers."""
    if not overlap_available():
        return [("not available", {})]
    return [("on", {OVERLAP_FIELD: False}), ("off", {OVERLAP_FIELD: True})]


def build_tiny_model(folder: Path, max_positions: int) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer and its real 49152-token vocabulary."""
    import transformers

    from radixlm.runtime.executor.loader import ModelLoadError, resolve_model

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"], eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    try:
        tok_folder = resolve_model("smollm2-135m").folder
    except ModelLoadError:  # a lent GPU has no built-in model; its random-weight twin has the tokenizer
        tok_folder = Path(os.environ.get("RADIXLM_GPU_MODELS", "/nonexistent")) / "tiny"
        if not (tok_folder / "tokenizer.json").exists():
            raise
    for name in TOKENIZER_FILES:
        if (tok_folder / name).exists():
            shutil.copy(tok_folder / name, folder / name)
    return folder


def prompts(n: int) -> list[str]:
    """Short distinct prompts (a dozen tokens, nothing shared past the first few words)."""
    return [f"{WORDS[i % len(WORDS)]} {i}: write a short story about a {WORDS[(i * 7 + 3) % len(WORDS)]}."
            for i in range(n)]


class Bench:
    """One Engine with the stub installed; runs one (batch, stub) measurement at a time."""

    def __init__(self, model: str, batches: list[int], steps: int, device: str, extra: dict):
        biggest = max(batches)
        self.engine = Engine(
            model=model, device=device, log_level="warning", max_running_requests=max(64, biggest),
            max_total_tokens=max(4096, biggest * (steps + 64)), chunked_prefill_size=max(2048, biggest * 32),
            **extra,
        )
        self.stub = StubForward(self.engine.runner)
        self.engine.runner.forward = self.stub  # the instance attribute shadows the method
        self.steps = steps
        self.step_calls: list[tuple[float, bool]] = []  # (ms of one Scheduler.step() call, ran a decode forward)
        self.profiler: cProfile.Profile | None = None
        sched = self.engine.scheduler
        original = sched.step

        def timed_step():
            n = len(self.stub.calls)
            prof = self.profiler
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()  # on the scheduler thread: cProfile follows the thread that enables it
            try:
                return original()
            finally:
                if prof is not None:
                    prof.disable()
                if self.stub.recording:
                    new = self.stub.calls[n:]
                    self.step_calls.append(((time.perf_counter() - t0) * 1e3,
                                            bool(new) and all(c.decode for c in new)))

        sched.step = timed_step  # the driver looks `step` up on every loop
        launch = sched.launch

        def timed_launch(batch):
            t0 = time.perf_counter()
            try:
                return launch(batch)
            finally:
                if self.stub.recording and batch.mode is ForwardMode.DECODE:
                    self.launch_ms.append(((time.perf_counter() - t0) * 1e3, batch.forward.batch_size))

        sched.launch = timed_launch  # looked up per call, on whichever thread launches
        self.launch_ms: list[tuple[float, int]] = []

    def run(self, batch: int, sleep_ms: float, steps: int | None = None) -> dict:
        steps = self.steps if steps is None else steps
        stub = self.stub
        stub.sleep_s = sleep_ms / 1e3
        stub.calls, stub.slept_ms, self.step_calls, self.launch_ms = [], [], [], []
        stub.recording = True
        params = {"max_new_tokens": steps + 1, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        try:
            outs = self.engine.generate(prompts(batch), params)
        finally:
            stub.recording = False
        elapsed = time.perf_counter() - t0
        got = [o["meta_info"]["completion_tokens"] for o in outs]
        if got != [steps + 1] * batch:
            raise RuntimeError(f"expected {steps + 1} tokens per request, got {sorted(set(got))}")
        if not stub.calls:  # e.g. a worker that took `runner.forward` before the stub went in
            raise RuntimeError("the forward stub was never called: the Engine no longer runs the model through "
                               "engine.runner.forward; install the stub where the forward is called now")
        wall, cpu = decode_steps(stub.calls, batch)
        step_ms = [ms for ms, decode in self.step_calls if decode]
        launch_ms = [ms for ms, b in self.launch_ms if b == batch]
        return {"wall_ms": wall, "cpu_ms": cpu, "step_call_ms": step_ms, "slept_ms": list(stub.slept_ms),
                "launch_ms": launch_ms,
                "elapsed_s": elapsed,
                "forward_calls": len(stub.calls), "prefill_calls": sum(not c.decode for c in stub.calls)}

    def close(self) -> None:
        self.engine.shutdown()



# ------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes")
    p.add_argument("--sleep-ms", type=float, default=3.0, help="the sleeping stub's forward time")
    p.add_argument("--steps", type=int, default=128, help="decode steps per request (max_new_tokens - 1)")
    p.add_argument("--repeats", type=int, default=1, help="runs per (batch, stub); steps are pooled")
    p.add_argument("--model", default="tiny",
                   help="tiny (a random 2-layer Llama with the real vocabulary, built here) or any --model")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--profile", action="store_true",
                   help="instead of measuring: cProfile the free stub at the largest batch")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.batch_list = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    if not args.batch_list or min(args.batch_list) < 1:
        p.error("--batches needs positive integers")
    if args.steps < 2:
        p.error("--steps must be >= 2")
    if args.sleep_ms < 0 or args.repeats < 1:
        p.error("--sleep-ms must be >= 0 and --repeats >= 1")
    return args


def profile(bench: Bench, batch: int) -> str:
    bench.run(batch, 0.0, steps=8)  # warm-up
    bench.profiler = cProfile.Profile()
    try:
        res = bench.run(batch, 0.0)
    finally:
        prof, bench.profiler = bench.profiler, None
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    buf.write(f"free stub, batch {batch}, {bench.steps} decode steps ({res['forward_calls']} forward calls, "
              f"{res['elapsed_s']:.2f} s under the profiler); time inside Scheduler.step() calls\n")
    stats.sort_stats("cumulative").print_stats(25)
    stats.sort_stats("tottime").print_stats(15)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    command = "python benchmarks/host_overhead.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    modes = overlap_modes()
    with contextlib.ExitStack() as stack:
        model = args.model
        if model == "tiny":
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="radixlm-tiny-")))
            model = str(build_tiny_model(folder, max_positions=max(2048, args.steps + 128)))
        if args.profile:
            bench = Bench(model, args.batch_list, args.steps, args.device, modes[0][1])
            try:
                text = profile(bench, max(args.batch_list))
            finally:
                bench.close()
            print(text)
            data = {"command": command, "profile": text,
                    "environment": environment(str(bench.stub.device), overlap_available())}
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
            return data

        total = len(modes) * len(args.batch_list) * 2 * args.repeats
        bar = tqdm(total=total, unit="run", disable=args.no_progress, desc="host overhead")
        rows, device = [], None
        for label, extra in modes:
            bench = Bench(model, args.batch_list, args.steps, args.device, extra)
            device = str(bench.stub.device)
            # on the CPU a step's sampling reads its logits (batch x vocab floats) as the stub left them:
            # at best at memory speed, measured on the thread that samples
            speed = bench.engine.runner.compute.run(read_speed) if bench.stub.device.type == "cpu" else None
            try:
                for b in args.batch_list:  # warm-up: first-call costs of every shape, both stubs
                    bench.run(b, 0.0, steps=4)
                bench.run(args.batch_list[0], args.sleep_ms, steps=4)
                for b in args.batch_list:
                    figs = {}
                    for name, ms in (("free", 0.0), ("sleep", args.sleep_ms)):
                        runs = []
                        for _ in range(args.repeats):
                            bar.set_postfix_str(f"overlap {label}, batch {b}, {name}")
                            runs.append(bench.run(b, ms))
                            bar.update()
                        figs[name] = summary(runs)
                    read_ms = b * bench.stub.vocab * 4 / speed / 1e6 if speed else None
                    rows.append(row(label, b, args.sleep_ms, figs["free"], figs["sleep"], read_ms))
            finally:
                bench.close()
        bar.close()

    table = markdown(rows, args.sleep_ms)
    print()
    print(table)
    if not overlap_available():
        print(f"\noverlap: not available (EngineArgs has no `{OVERLAP_FIELD}`)")
    env = environment(device, overlap_available())
    print(f"\n{device}, torch {env['torch']} ({env['torch_threads']} threads), model {args.model}, "
          f"{args.steps} decode steps per request; medians over decode steps at the full batch")
    data = {
        "command": command,
        "config": {"batches": args.batch_list, "sleep_ms": args.sleep_ms, "steps": args.steps,
                   "repeats": args.repeats, "model": args.model, "device": args.device, "threads": args.threads},
        "overlap": "available" if overlap_available() else "not available",
        "environment": env,
        "results": rows,
        "markdown": table,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return data


if __name__ == "__main__":
    main()


def read_speed() -> float:
    """GB/s of one float32 sum over 256 MiB on the calling thread's team (best of 5): larger than any
    cache, so it reads from memory as a weight stream or a cold logits tensor does."""
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9
