"""Compiles every Triton kernel launch our launchers make, for an sm_90 GPU (H100 / H200), on a
machine without one: run as a script in a process without TRITON_INTERPRET (tests/test_triton_compile.py).

Under the interpreter a kernel runs as Python, so what only the compiler checks (a loop-carried value
that changes type, a constexpr reassigned in a loop, an op the backend cannot lower) shows first on
a lent GPU. Here each kernel's module attribute is replaced by a recorder: the launchers run on CPU
tensors as they would on the GPU, and each launch is compiled (front end, Triton's GPU passes,
LLVM, ptxas) from its arguments' types and constexprs instead of run. Prints one line a compiled
variant; exits non-zero on the first failure."""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("run without TRITON_INTERPRET: the interpreter replaces the kernels this compiles")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from radixlm.runtime.executor.attention import triton_kernels as attention  # noqa: E402
from radixlm.runtime.executor.models import moe_triton, triton_layer_ops  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
         torch.int32: "i32", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1"}
TARGET = GPUTarget("cuda", 90, 32)
compiled: set[tuple] = set()


class Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **constexprs)` compiles instead of running."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return self.compile

    def compile(self, *args, **kwargs):
        values = {**dict(zip(self.fn.arg_names, args)), **kwargs}
        signature, constants = {}, {}
        for p in self.fn.params:
            v = values.get(p.name, p.default)
            if p.is_constexpr or v is None:
                signature[p.name], constants[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                signature[p.name] = "*" + TYPES[v.dtype]
            elif isinstance(v, bool):
                signature[p.name] = "i1"
            elif isinstance(v, int):
                signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            elif isinstance(v, float):
                signature[p.name] = "fp32"
            else:
                raise TypeError(f"{self.fn.__name__}: argument {p.name} = {v!r}")
        key = (self.fn.__name__, tuple(signature.items()), tuple((k, repr(v)) for k, v in constants.items()))
        if key in compiled:
            return
        triton.compile(ASTSource(self.fn, signature, constants), target=TARGET)
        compiled.add(key)
        shown = ", ".join(f"{k}={v}" for k, v in constants.items() if k.isupper())
        print(f"ok {self.fn.__name__}({shown}) {' '.join(t for t in signature.values() if t != 'constexpr')}")


def record(module, *names: str) -> None:
    for name in names:
        setattr(module, name, Recorder(getattr(module, name)))


def attention_launches() -> None:
    """SmolLM2's heads (9 over 3 KV heads, dim 64) in float32 (exact products) and bfloat16 (TF32
    ones): one split written directly; a cascade with windows; in bfloat16 also a graph's plan."""
    heads, kv_heads, dim = 9, 3, 64
    for dtype in (torch.float32, torch.bfloat16):
        b, slots, width = 5, 4096, 2049
        q = torch.zeros(b, heads, dim, dtype=dtype)
        pool_k = pool_v = torch.zeros(slots, kv_heads, dim, dtype=dtype)
        table = torch.zeros(8, width, dtype=torch.int64)
        rows = seq_lens = torch.zeros(b, dtype=torch.int64)
        start = torch.zeros(1, dtype=torch.int64)
        plans = ((1, 0, 0), (2, 3, 12)) + (((16, 16, 0),) if dtype == torch.bfloat16 else ())
        for splits, shared, window in plans:
            mid_o = torch.zeros(b, heads, splits + shared, dim)
            mid_lse = torch.zeros(b, heads, splits + shared)
            attention.decode(q, pool_k, pool_v, torch.zeros_like(q), table, rows, seq_lens, start, splits, shared,
                             mid_o, mid_lse, dim ** -0.5, window)
        qo_indptr = torch.arange(b + 1, dtype=torch.int64) * 40
        for window in (0, 12):
            tokens = torch.zeros(40 * b, heads, dim, dtype=dtype)
            attention.extend(tokens, pool_k, pool_v, torch.zeros_like(tokens), qo_indptr, table, rows, seq_lens,
                             40, dim ** -0.5, window)


def layer_launches() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(3, 576, dtype=dtype)
        triton_layer_ops.add_rms_norm(x, None, torch.ones(576, dtype=dtype), 1e-5)
        triton_layer_ops.add_rms_norm(x, torch.zeros_like(x), torch.ones(576, dtype=dtype), 1e-5)
        triton_layer_ops.silu_mul(torch.zeros(3, 2 * 1536, dtype=dtype))
        for heads, kv_heads, dim, rot in ((24, 8, 96, 72),):  # Phi-4-mini: 3/4 of a head rotated
            qkv = torch.zeros(3, heads + 2 * kv_heads, dim, dtype=dtype)
            cos = sin = torch.zeros(3, 1, rot, dtype=dtype)
            pool = torch.zeros(64, kv_heads, dim, dtype=dtype)
            triton_layer_ops.rope_store(qkv, cos, sin, heads, kv_heads, torch.arange(3), pool, pool)


def moe_launches() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        experts, hidden, inter, tokens, top_k = 8, 64, 48, 7, 2
        x = torch.zeros(tokens, hidden, dtype=dtype)
        w13 = torch.zeros(experts, 2 * inter, hidden, dtype=dtype)
        w2 = torch.zeros(experts, hidden, inter, dtype=dtype)
        ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts
        moe_triton.fused_experts(x, w13, w2, ids, torch.full((tokens, top_k), 0.5))


if __name__ == "__main__":
    record(attention, "_decode_kernel", "_merge_splits_kernel", "_extend_kernel")
    record(triton_layer_ops, "_add_rms_norm_kernel", "_silu_mul_kernel", "_rope_store_kernel")
    record(moe_triton, "_grouped_matmul")
    attention_launches()
    layer_launches()
    moe_launches()
    print(f"{len(compiled)} kernel variants compiled for {TARGET.backend} sm_{TARGET.arch}")
