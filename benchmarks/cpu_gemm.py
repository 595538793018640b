"""CPU matmul kernels on a model's shapes: torch's F.linear (MKL for float32) against oneDNN, and
with `--int8` the int8 kernels of `--quantization int8` against oneDNN float32.

    python benchmarks/cpu_gemm.py [--model smollm2-135m] [--rows 1,16,256,2048] [--threads 1] [--int8]

For every weight shape of the model (fused q/k/v, o, fused gate/up, down, lm_head) and every row
count (1 = a decode step of one request, 2048 = a full prefill chunk) it times `F.linear` and
`torch.ops.mkldnn._linear_pointwise` (what `--cpu-gemm auto` picks) on the same float32 tensors and
prints GFLOP/s and the ratio. The model's config is read; no weights are loaded (random values).
`--int8`: per shape and row count, oneDNN float32 against each int8 kernel of
`runtime/executor/models/quantized_linear.py` as a layer runs it (per-row activation quantization
and output scaling included) and against fbgemm's fp16 kernel (`--quantization fp16`,
`models/half_linear.py`), interleaved, best of `--repeats`; a weight this small stays in cache,
so decode-sized rows here understate what int8 saves when every weight comes from memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from radixlm.runtime.executor.loader import load_config, resolve_model  # noqa: E402
from radixlm.runtime.executor.models.linear import onednn_linear, onednn_usable  # noqa: E402


def shapes(config) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of the model's matmuls."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    h, inter = config.hidden_size, config.intermediate_size
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, h), "o": (h, heads * head_dim),
            "gate_up": (2 * inter, h), "down": (h, inter), "lm_head": (config.vocab_size, h)}


def seconds(fn, min_time: float = 0.2) -> float:
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def int8_table(model_shapes: dict[str, tuple[int, int]], rows: list[int], repeats: int) -> int:
    from radixlm.runtime.executor.models import half_linear as hl
    from radixlm.runtime.executor.models import quantized_linear as ql

    kernels = [k for k in ql.KERNELS.values() if ql._probe(k) is None]
    fp16 = hl.fp16_unavailable() is None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); int8 kernels: "
          f"{', '.join(k.name for k in kernels) or 'none usable'} (first = --quantization int8's); "
          f"fp16: {'fbgemm' if fp16 else hl.fp16_unavailable()}")
    names = [f"{k.name} int8" for k in kernels] + (["fp16"] if fp16 else [])
    print("| matmul | rows x in -> out | oneDNN f32 (us) | " + " | ".join(f"{name} (us) | {name} / f32"
                                                           for name in names) + " |")
    print("|---|---|--:|" + "--:|--:|" * len(names))
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, (n, k) in model_shapes.items():
            w = torch.randn(n, k, generator=gen) * 0.05
            layers = [ql.Int8Linear(*ql.quantize_weight(w), None, kernel) for kernel in kernels]
            layers += [hl.Fp16Linear(w, None)] if fp16 else []
            for m in rows:
                x = torch.randn(m, k, generator=gen)
                fns = [lambda x=x, w=w: onednn_linear(x, w, None)] + [lambda x=x, layer=layer: layer(x)
                                                                      for layer in layers]
                best = [seconds(fn, 0.05) for fn in fns]
                for _ in range(repeats - 1):  # interleaved: load from other jobs hits every kernel alike
                    best = [min(b, seconds(fn, 0.05)) for b, fn in zip(best, fns)]
                cells = " | ".join(f"{t * 1e6:.0f} | {best[0] / t:.2f}x" for t in best[1:])
                print(f"| {name} | {m} x {k} -> {n} | {best[0] * 1e6:.0f} | {cells} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rows", default="1,16,256,2048")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    p.add_argument("--int8", action="store_true",
                   help="compare the int8 kernels and the fp16 one with oneDNN float32 instead")
    p.add_argument("--repeats", type=int, default=5, help="--int8: interleaved rounds (best of)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    why_not = onednn_usable(torch.device("cpu"), torch.float32)
    if why_not:
        print(f"oneDNN not usable here: {why_not}", file=sys.stderr)
        return 1
    config = load_config(resolve_model(args.model).folder)
    rows = [int(r) for r in args.rows.split(",")]
    if args.int8:
        return int8_table(shapes(config), rows, args.repeats)
    cases = [(name, n, k, m) for name, (n, k) in shapes(config).items() for m in rows]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| matmul | rows x in -> out | F.linear GFLOP/s | oneDNN GFLOP/s | oneDNN / F.linear |")
    print("|---|---|--:|--:|--:|")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, n, k, m in tqdm(cases, desc="matmuls", leave=False):
            x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            flop = 2 * m * n * k
            a = seconds(lambda x=x, w=w: F.linear(x, w))
            b = seconds(lambda x=x, w=w: onednn_linear(x, w, None))
            tqdm.write(f"| {name} | {m} x {k} -> {n} | {flop / a / 1e9:.0f} | {flop / b / 1e9:.0f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
