"""Where one client's decode step goes: matmuls, attention and the rest, against the memory's speed.

    python benchmarks/decode_split.py [--model smollm2-135m] [--quantization int8] [--threads 1]
        [--attention-backend NAME] [--enable-torch-compile] [--context 40] [--steps 40] [--json PATH]
        [--rows 8 --shared-tokens 2500]

Runs one greedy request for `--context` tokens (or `--rows` of them, behind a cached system prompt
of `--shared-tokens` that all of them hold: a decode behind a shared prompt), keeps its last decode
batch, and replays that batch through the model on the runner's compute thread, where the engine
runs steps: as it is, with every quantized or dense matmul replaced by a zero tensor of its output's
shape, with the attention backend's decode replaced by a copy of q, and with both. The differences are each part's time.
Beside it: the bytes of weights a step reads, and how fast a sum on as many threads reads a 256 MiB
float32 tensor, so the matmuls' time can be read against the memory's speed (a decode step at one
row is a read of every weight).
`--threads` sets the process's count, which the steps run on; the report names the count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # its sibling, when loaded by path
from memory_speed import read_speed  # noqa: E402

from radixlm.runtime import Engine  # noqa: E402
from radixlm.runtime.executor import compiled_forward  # noqa: E402
from radixlm.runtime.executor.models import half_linear as hl  # noqa: E402
from radixlm.runtime.executor.models import linear as dense  # noqa: E402
from radixlm.runtime.executor.models import llama  # noqa: E402
from radixlm.runtime.executor.models import quantized_linear as ql  # noqa: E402


def step_ms(forward, batch, repeats: int) -> float:
    for _ in range(5):
        forward(batch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward(batch)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step at one row reads (packed int8 layers, dense weights)."""
    total = 0
    for m in model.modules():
        if isinstance(m, ql.Int8Linear):  # not a second packing (int8_batch_packing): one row never reads it
            total += m.nbytes - (0 if m.many is None else m.many.packed_bytes(m.out_features, m.in_features))
        elif isinstance(m, hl.Fp16Linear):
            total += m.nbytes
        elif isinstance(m, dense.Linear):
            total += m.weight.numel() * m.weight.element_size()
    head = getattr(model, "lm_head", None)
    if head is None:  # tied: the lm_head reads the embedding
        total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def shared_prompt(engine: Engine, tokens: int) -> str:
    """A system prompt of at least `tokens` tokens (numbered rules)."""
    rules, text = 0, ""
    while len(engine.tokenizer.encode(text)) < tokens:
        text += "".join(f"Rule {rules + i}: answer briefly, precisely and kindly. " for i in range(10))
        rules += 10
    return text


def last_decode_batch(engine: Engine, context: int, rows: int = 1, shared_tokens: int = 0):
    """The last decode batch of `rows` greedy requests of `context` tokens, behind a shared prompt of
    `shared_tokens` tokens if any, cached first so that every row holds it in the same slots (the
    runner's forward is restored afterwards)."""
    runner = engine.runner
    params = {"max_new_tokens": context, "temperature": 0, "ignore_eos": True}
    if shared_tokens:
        system = shared_prompt(engine, shared_tokens)
        prompts = [f"{system}Question {i}: what is {i} plus {i}?" for i in range(rows)]
        engine.generate(system, {**params, "max_new_tokens": 1})
    else:
        prompts = ["The capital of France is"] * rows
    forward, seen = runner.forward, []
    runner.forward = lambda batch: seen.append(batch) or forward(batch)
    try:
        engine.generate(prompts, [params] * rows)
    finally:
        del runner.forward  # the instance attribute goes: the method is back
    return seen[-1]


class Stubs:
    """Swaps the matmuls and the attention decode for stand-ins that cost (almost) nothing."""

    def __init__(self, runner):
        self.model = runner.model
        self.compiled = runner.compiled is not None
        self.int8 = [m for m in self.model.modules() if isinstance(m, ql.Int8Linear)]
        self.kernel = self.int8[0].kernel if self.int8 else None
        self.attn = self.model.layers[0].self_attn.attn  # one backend object serves every layer
        self.fp16 = [m for m in self.model.modules() if isinstance(m, hl.Fp16Linear)]
        self.products = runner.compiled.products if self.compiled else None  # the compiled graph's op finds these
        self._matmul = self.kernel.matmul if self.kernel else None
        self._raw = self.kernel.raw if self.kernel else None  # a split kernel's product (quantized_linear._split)
        self._linear = dense.linear
        self._decode = self.attn.forward_decode

    def matmuls(self, on: bool) -> None:
        if self.kernel is not None:
            width = {id(m.packed): m.out_features for m in self.int8}
            fake = (lambda xq, packed: torch.zeros(xq.shape[0], width[id(packed)])) if on else self._matmul
            object.__setattr__(self.kernel, "matmul", fake)  # a frozen dataclass: the modules share it
            if self._raw is not None:
                object.__setattr__(self.kernel, "raw", (lambda h, packed: torch.zeros(h.shape[0], width[id(packed)]))
                                   if on else self._raw)
        for m in self.fp16:
            if on:
                m.product = lambda rows, n=m.out_features: rows.new_zeros(rows.shape[0], n)
            elif "product" in vars(m):
                del m.product  # the method is back
            if self.products is not None:
                self.products[m.tag.data_ptr()] = m.product
        zero = (lambda x, w, b, onednn, min_rows=1: x.new_zeros(*x.shape[:-1], w.shape[0])) if on else self._linear
        if self.compiled:  # the graph guards on the model's globals: swap what its matmul op calls instead
            compiled_forward.linear = zero
            return
        dense.linear = zero
        llama.linear = zero

    def attention(self, on: bool) -> None:
        copy = (lambda q, k, v, layer, batch: q.reshape(q.shape[0], -1, q.shape[-1]).clone()) if on else self._decode
        self.attn.forward_decode = copy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", default="int8")
    p.add_argument("--attention-backend", default=None, help="default: the mode's own (int8: invariant)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=40, help="tokens generated before the replayed step")
    p.add_argument("--rows", type=int, default=1, help="requests decoding together")
    p.add_argument("--shared-tokens", type=int, default=0,
                   help="a system prompt of at least this many tokens that every row holds (the cascade decode)")
    p.add_argument("--steps", type=int, default=40, help="replays per measurement")
    p.add_argument("--enable-torch-compile", action="store_true", help="the compiled forward (compiled_forward.py)")
    p.add_argument("--json")
    args = p.parse_args()

    torch.set_num_threads(args.threads)  # before the engine: its steps take the process's count from here
    extra = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    engine = Engine(model=args.model, quantization=args.quantization, log_level="warning",
                    disable_overlap_schedule=True, enable_torch_compile=args.enable_torch_compile, **extra)
    runner = engine.runner
    forward, batch = runner.forward, last_decode_batch(engine, args.context, args.rows, args.shared_tokens)
    stubs = Stubs(runner)
    rows = {}
    cases = [("as is", False, False), ("matmuls stubbed", True, False), ("attention stubbed", False, True),
             ("both stubbed", True, True)]

    def replays():  # on the runner's compute thread, where the engine runs its steps: another thread
        # would start a second OpenMP pool, and libgomp then throttles both (executor/compute_thread.py)
        for label, matmuls, attention in tqdm(cases, desc="decode split", unit="case"):
            stubs.matmuls(matmuls)
            stubs.attention(attention)
            rows[label] = step_ms(forward, batch, args.steps)
        stubs.matmuls(False)
        stubs.attention(False)
        seen["threads"], seen["read"] = torch.get_num_threads(), read_speed()  # the steps' team

    seen: dict = {}
    runner.compute.run(replays)
    engine.shutdown()
    threads, speed = seen["threads"], seen["read"]
    whole = rows["as is"]
    matmul_ms = whole - rows["matmuls stubbed"]
    attention_ms = whole - rows["attention stubbed"]
    weights = weight_bytes(runner.model)
    compiled = ", compiled forward" if args.enable_torch_compile else ""
    print(f"\n{args.model}, {args.quantization}{compiled}, {stubs.attn.name} attention, {threads} thread(s), "
          f"decode step of {batch.batch_size} row(s) at {batch.seq_lens_host[0]} tokens of context"
          f"{f', {batch.shared_prefix_len} shared' if batch.shared_prefix_len else ''} (medians of {args.steps})\n")
    print("| part | ms per step | share |\n|---|--:|--:|")
    for label, ms in (("whole step", whole), ("matmuls (whole - matmuls stubbed)", matmul_ms),
                      ("attention (whole - attention stubbed)", attention_ms),
                      ("everything else (both stubbed)", rows["both stubbed"])):
        print(f"| {label} | {ms:.2f} | {ms / whole:.0%} |")
    print(f"\nweights read per step: {weights / 2**20:.0f} MiB; a {threads}-thread sum reads {speed:.1f} GB/s, "
          f"so the weights alone take >= {weights / speed / 1e6:.1f} ms; the matmuls ran at "
          f"{weights / matmul_ms / 1e6:.1f} GB/s ({weights / matmul_ms / 1e6 / speed:.0%} of that)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ms": rows, "weight_bytes": weights, "read_gbps": speed}, f, indent=1)


if __name__ == "__main__":
    main()
