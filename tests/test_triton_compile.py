"""Every Triton kernel our launchers start compiles for an sm_90 GPU (H100 / H200), here without one:
tests/triton_sm90_compile.py runs the launchers on CPU tensors with each kernel replaced by a
recorder that compiles the launch (Triton's front end and GPU passes, LLVM, ptxas) instead of running
it. The interpreter the other kernel tests use runs a kernel as Python, so an error only the compiler
sees (a loop-carried value changing type, an op the backend cannot lower) would first show on a
lent GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("triton_sm90_compile.py")


def test_every_kernel_launch_compiles_for_sm90(tmp_path):
    triton = pytest.importorskip("triton", reason="the kernels need the triton package (the dev extra has it)")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip(f"triton {triton.__version__} has no CUDA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh: a cached kernel would skip the compiler
    out = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    lines = out.stdout.splitlines()
    kernels = {line.split()[1].split("(")[0] for line in lines if line.startswith("ok ")}
    assert kernels == {"_decode_kernel", "_merge_splits_kernel", "_extend_kernel", "_add_rms_norm_kernel",
                       "_silu_mul_kernel", "_rope_store_kernel", "_grouped_matmul"}, lines
