"""The engine's options in one dataclass: Engine(**kwargs) takes its fields; the HTTP server's
ServerArgs (server/server_args.py) adds its own to them, and every field of both is a CLI flag."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from radixlm.runtime import launch_flags

SCHEDULE_POLICIES = ("lpm", "fcfs")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "invariant")  # executor/attention/__init__.py
# executor/cpu/quantization.py; none = float32; auto = fp16 on the CPU where it runs (benchmarks/quality.py)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "fp16", "int4")
# Kernel choices the runtime makes itself (models/linear.py, cpu/int8.py). An environment
# variable forces one, for debugging; the old flags (cpu_gemm, int8_batch_packing) still do, with a warning.
GEMM_CHOICES = ("auto", "onednn", "torch")
BATCH_PACKING_CHOICES = ("auto", "off")
FORCED_KERNELS = {"cpu_gemm": ("RADIXLM_CPU_GEMM", GEMM_CHOICES),
                  "int8_batch_packing": ("RADIXLM_INT8_BATCH_PACKING", BATCH_PACKING_CHOICES)}
DEFAULT_CUDA_GRAPH_MAX_BS = 256  # SGLang's cap: larger decode batches are compute-bound, graphs gain little


@dataclass(slots=True)
class EngineArgs:
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    context_length: int | None = None  # default: the model's max_position_embeddings
    max_total_tokens: int | None = None  # KV pool size in tokens; default from memory
    kv_memory_gb: float | None = None  # KV pool budget when max_total_tokens is unset
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048  # max new tokens per prefill batch
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    # auto = triton on CUDA; on the CPU invariant where answers must not depend on the batch (int8 weights,
    # --enable-deterministic-inference), else torch | torch | triton | invariant (CPU)
    attention_backend: str = "auto"
    # SGLang's flag: a request's answer never depends on its batch (batch-invariant attention, the only
    # thing that selects it, and float32 matmuls that keep a row's bits in any batch)
    enable_deterministic_inference: bool = False
    # CPU matmul weights, the one CPU knob: auto (fp16 on the CPU, see resolve_quantization; float32
    # elsewhere) | none (float32) | int8 (per-channel weights, per-token inputs) | fp16 (weights only)
    # | int4 (4-bit groups; a Q4_0 / Q4_1 / Q4_K GGUF's own blocks: cpu/int4.py)
    quantization: str = "auto"
    cpu_gemm: str = "auto"  # deprecated: the float32 CPU kernel is chosen automatically (RADIXLM_CPU_GEMM)
    int8_batch_packing: str = "auto"  # deprecated: automatic (RADIXLM_INT8_BATCH_PACKING)
    # SGLang's flag. CPU: the model's forward compiled by torch.compile (inductor), one graph for every batch;
    # int8 decodes one client ~1.3x faster, start-up compiles (seconds; the first time tens of seconds)
    enable_torch_compile: bool = False
    grammar_backend: str = "llguidance"  # chosen by benchmarks/constrained.py (see benchmarks/README.md)
    disable_jump_forward: bool = False
    disable_overlap_schedule: bool = False  # overlap: the host schedules step N+1 while step N runs
    # decode as CUDA-graph replays at bucketed batch sizes (CUDA only; executor/cuda_graph.py)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None  # largest recorded batch; None = min(max_running_requests, 256)
    grammar_compile_timeout: float = 30.0  # seconds a request waits for its grammar before a 400
    random_seed: int = 0  # seeds unseeded sampling (torch's default generator) when the scheduler starts
    # SGLang's flag: a streamed chunk (Engine.generate(stream=True), POST /generate) carries only its new text
    # and ids; by default each carries the text and ids so far, as SGLang's do
    incremental_streaming_output: bool = False
    log_level: str = "info"
    # KV snapshots (runtime/scheduler/snapshot.py): the hottest part of the radix cache is saved to this file on
    # shutdown and POST /cache/save, and loaded at start-up; only the operator names the file, never a request
    cache_snapshot: str | None = None
    cache_snapshot_max_tokens: int = 16384  # tokens a snapshot keeps at most (float32 SmolLM2-135M: 45 KiB each)
    # SGLang / vLLM launch flags (launch_flags.py has their other spellings)
    chat_template: str | None = None  # a Jinja file (or the template text) replacing the model's own
    mem_fraction_static: float | None = None  # CUDA: share of total GPU memory for weights + KV pool
    tp_size: int = 1  # one device: only 1 is accepted
    dp_size: int = 1  # one replica per server: --replicas N scales out
    trust_remote_code: bool = False  # accepted; nothing runs from a checkpoint (architectures are built in)

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        for name in ("max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")
        check_seconds(self, "grammar_compile_timeout")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.cpu_gemm not in GEMM_CHOICES:
            raise ValueError(f"cpu_gemm must be one of {GEMM_CHOICES}, got {self.cpu_gemm!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}")
        if self.int8_batch_packing not in BATCH_PACKING_CHOICES:
            raise ValueError(f"int8_batch_packing must be one of {BATCH_PACKING_CHOICES}, "
                             f"got {self.int8_batch_packing!r}")
        if self.chunked_prefill_size < 2:
            raise ValueError("chunked_prefill_size must be >= 2")
        if self.cache_snapshot_max_tokens < 1:
            raise ValueError(f"cache_snapshot_max_tokens must be >= 1, got {self.cache_snapshot_max_tokens}")
        if self.cache_snapshot is not None and not self.cache_snapshot.strip():
            raise ValueError("cache_snapshot must be a file path (or unset)")
        launch_flags.check(self.tp_size, self.dp_size, self.mem_fraction_static)

    def forced_kernel(self, name: str) -> str:
        """The kernel choice `name` (a FORCED_KERNELS key): "auto" unless its environment variable, or
        its deprecated flag (logged once), forces one."""
        env, choices = FORCED_KERNELS[name]
        flag = getattr(self, name)
        if flag != "auto":
            _deprecated_flag(name, env)
            return flag
        forced = os.environ.get(env, "auto")
        if forced not in choices:
            raise ValueError(f"{env} must be one of {choices}, got {forced!r}")
        return forced

    @property
    def graph_max_bs(self) -> int:
        """The largest decode batch run as a graph replay: a batch never has more rows than
        max_running_requests, so buckets above it would be recorded for nothing."""
        return min(self.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, self.max_running_requests)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """The options from keywords: a TypeError names any no API defines. SGLang's and vLLM's
        spellings of ours are accepted (`model_path`); the HTTP server's own options are accepted and
        change nothing here (SGLang's Engine takes its ServerArgs' fields)."""
        known = {f.name for f in dataclasses.fields(cls)}
        for alias, field in launch_flags.KEYWORD_ALIASES.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if field in kwargs and kwargs[field] != value:
                    raise TypeError(f"{alias}={value!r} and {field}={kwargs[field]!r} name the same option")
                kwargs[field] = value
        kwargs = {k: v for k, v in kwargs.items() if k in known or k not in launch_flags.SERVER_ONLY}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown {cls.__name__} option(s): {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *launch_flags.ALIASES.get(f.name, ())]
            if f.type in ("bool", bool):
                parser.add_argument(*flags, dest=f.name, action="store_true", default=f.default)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            if str(f.type).startswith("int"):
                kind = int
            elif str(f.type).startswith("float"):
                kind = float
            parser.add_argument(*flags, dest=f.name, type=kind, default=f.default)
        launch_flags.add_extra_flags(parser)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@functools.cache
def _deprecated_flag(name: str, env: str) -> None:
    logging.getLogger(__name__).warning(
        "--%s is deprecated: the kernel is chosen automatically, and %s forces one for debugging",
        name.replace("_", "-"), env)


def check_seconds(args: Any, *names: str) -> None:
    """ValueError unless each named field is a finite number of seconds >= 0."""
    for name in names:
        if not 0 <= getattr(args, name) < float("inf"):
            raise ValueError(f"{name} must be a finite number >= 0, got {getattr(args, name)}")
