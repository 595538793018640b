"""Loads the model and the KV pool, and runs one forward pass for a scheduled batch."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor import host_memory
from radixlm.runtime.executor.attention import create_attention_backend, resolve_backend_name
from radixlm.runtime.executor.compiled_forward import CompiledForward, use_cache_dir
from radixlm.runtime.executor.compute_thread import hand_back_gil_promptly
from radixlm.runtime.executor.compute_thread import shared as shared_compute_thread
from radixlm.runtime.executor.cpu.contention import ThreadGovernor
from radixlm.runtime.executor.cpu.fp16 import to_fp16
from radixlm.runtime.executor.cpu.gguf_embedding import map_file_embeddings
from radixlm.runtime.executor.cpu.int4 import Int4Linear, bf16_matmuls, has_4bit_matmuls, int4_from_file, round_to_int4
from radixlm.runtime.executor.cpu.int8_file import mapped_weight_bytes
from radixlm.runtime.executor.cpu.quantization import load_quantized, resident_weight_bytes, resolve_quantization
from radixlm.runtime.executor.cuda_graph import graph_runner_for
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardBatch
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from radixlm.runtime.executor.loader import (
    default_cache_dir,
    load_config,
    load_tokenizer,
    load_weights,
    resolve_dtype,
    resolve_model,
)
from radixlm.runtime.executor.model_config import head_shape, sliding_window
from radixlm.runtime.executor.models import get_model_class
from radixlm.runtime.executor.models.linear import choose_gemm, rows_invariant

logger = logging.getLogger(__name__)

DEBUG_KV_ENV = "RADIXLM_DEBUG_KV"

DEFAULT_CPU_KV_GB = 2.0
CUDA_KV_FRACTION = 0.8  # of the memory left after weights
CPU_KV_AVAILABLE_SHARE = 0.5  # the default CPU pool takes at most this share of the memory available at start


@contextlib.contextmanager
def _skip_init():
    """Random init of 100M+ parameters costs seconds and is overwritten by load_weights anyway."""
    saved = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


# glibc mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MALLOC_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest; bigger blocks are mmapped and unmapped on free
MALLOC_TRIM_THRESHOLD = 2**30


def keep_freed_memory() -> bool:
    """Lets glibc keep freed blocks of up to 32 MiB for reuse instead of handing them back to the OS.

    A CPU forward allocates and frees MiB-sized activations op after op; with glibc's defaults many
    of them come straight from mmap, and every first write to a fresh page faults: 0.3-0.5 s of
    system time in a 3 s prefill of 1,700 tokens, and elementwise ops 5-8x slower than into a reused
    buffer. Process-wide and harmless under another allocator (jemalloc / tcmalloc via LD_PRELOAD do
    not read these settings). False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return (libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1
                and libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1)
    except (OSError, AttributeError):
        return False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return device


class ModelRunner:
    def __init__(self, args: EngineArgs):
        # loads here and runs every step there: one OpenMP pool in the process (compute_thread.py)
        self.compute = shared_compute_thread()
        self.compute.run(self._load, args)

    def _load(self, args: EngineArgs) -> None:
        start = time.perf_counter()
        self.device = resolve_device(args.device)
        if self.device.type == "cuda":
            hand_back_gil_promptly()
        if self.device.type == "cpu" and not keep_freed_memory():
            logger.debug("malloc left as it is (no glibc)")
        self.dtype = resolve_dtype(args.dtype, self.device)
        source = resolve_model(args.model)
        self.model_path = str(source.folder)
        self.config = load_config(source.folder)
        cfg = self.config
        max_pos = getattr(cfg, "max_position_embeddings", 4096)
        model_cls = get_model_class(cfg)
        window = None if model_cls.windowed else sliding_window(cfg)
        if window is not None and window < max_pos:
            # the attention kernels see every key: within the window they give the model's own answer
            logger.info("context capped at the model's %d-token sliding window (of %d positions)", window, max_pos)
            max_pos = window
        self.context_len = min(args.context_length or max_pos, max_pos)
        self.vocab_size = cfg.vocab_size
        num_heads, self.num_kv_heads, self.head_dim = head_shape(cfg)
        shape = dict(num_heads=num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, device=self.device)
        # only --enable-deterministic-inference asks for batch-invariant attention (its start-up probe
        # refuses a CPU where it cannot keep that promise)
        name = resolve_backend_name(args.attention_backend, self.device.type, args.enable_deterministic_inference)
        self.attn_backend = create_attention_backend(name, **shape)
        with torch.device(self.device), _skip_init():
            model = model_cls(cfg, self.attn_backend, max_positions=self.context_len)
        self.num_params = sum(p.numel() for p in model.parameters())
        file_4bit = args.quantization == "auto" and self.device.type == "cpu" and has_4bit_matmuls(source.folder)
        self.quantization = resolve_quantization(args.quantization, self.device, self.dtype,
                                                 args.enable_deterministic_inference, file_4bit)
        if args.enable_deterministic_inference and self.quantization == "fp16":  # before any weight is read
            raise ValueError("--enable-deterministic-inference cannot run fp16 matmuls: fbgemm's fp16 kernel rounds a "
                             "row by how many rows share its product; use --quantization int8 or none")
        q = None
        from_file: frozenset[str] = frozenset()
        t0 = time.perf_counter()
        if self.quantization == "int4":  # before the weights: those the file's blocks replace are never read
            from_file = int4_from_file(model, source.folder)
        int4_s = time.perf_counter() - t0
        # the tokenizer is read on a thread of its own from here: that is mostly transformers' Python, and what
        # follows (the weights copied in, fbgemm packing the head) is native code that lets it run
        reader = ThreadPoolExecutor(1, thread_name_prefix="radixlm-tokenizer")
        tokenizer = reader.submit(load_tokenizer, source.folder, args.chat_template)
        reader.shutdown(wait=False)
        if self.quantization in ("none", "fp16", "int4"):
            model.load_weights(load_weights(source.folder, self.dtype, self.device, skip=from_file))
        else:  # int8 weights from their cache file, or quantized now and cached (executor/cpu/quantization.py)
            q = load_quantized(model, source.folder, self.quantization, default_cache_dir(), tokenizer.result(),
                               self.attn_backend, self.context_len, args.forced_kernel("int8_batch_packing"))
            logger.info("%s weights on %s: %s %s in %.1fs", q.mode, q.kernel,
                        "read from" if q.reused else "quantized and cached in", q.path, q.seconds)
        # int4 runs float32 models only, built so: .to would widen its bfloat16 scales
        self.model = (model if self.quantization == "int4" else model.to(self.dtype)).eval()
        if self.quantization == "int4":  # the layers' matmuls; the embeddings and lm_head go fp16 below
            # chosen by auto, a matmul the file holds in more bits stays fp16; asked for, every one is 4-bit
            t0 = time.perf_counter()
            rounded = round_to_int4(self.model) if args.quantization == "int4" else 0
            read = sum(isinstance(m, Int4Linear) for m in self.model.modules()) - rounded
            logger.info("int4 weights: %d matmuls from the GGUF's own blocks, %d rounded to 4 bits, in %.1fs; "
                        "long prefills on bfloat16 matmuls and attention: %s", read, rounded,
                        int4_s + time.perf_counter() - t0,
                        "yes" if bf16_matmuls() else "no (no bfloat16 dot products on this CPU)")
        if self.quantization in ("fp16", "int4"):  # packed from the float32 weights, which are dropped
            t0 = time.perf_counter()
            layers = to_fp16(self.model)
            logger.info("fp16 weights (fbgemm): %d matmuls packed in %.1fs", layers, time.perf_counter() - t0)
        if self.quantization in ("fp16", "int4") and map_file_embeddings(self.model, source.folder):
            logger.info("token embeddings: the GGUF's Q8_0 rows, mapped")
        self.tokenizer = tokenizer.result()  # before the kernels are timed below, with no other thread running
        # float32 matmuls: the attention's, or all of them
        self.gemm = choose_gemm(args.forced_kernel("cpu_gemm"), self.device, self.dtype)
        self.matmuls = {"none": self.gemm, "fp16": "fp16 (fbgemm)", "int4": "int4 (torch, groups of 32)"}.get(
            self.quantization) or f"{q.mode} ({q.kernel})"
        self.model.set_gemm(self.gemm, self._deterministic_rows(args, self.quantization == "none"))
        self.attn_backend.set_gemm(self.gemm)
        self.attn_backend.set_bf16_extends(self.quantization == "int4" and bf16_matmuls())
        weight_bytes = resident_weight_bytes(self.model)  # packed int8 where quantized

        num_slots = self._kv_pool_size(args, weight_bytes)
        self.kv_pool = KVPool(num_slots, cfg.num_hidden_layers, self.num_kv_heads, self.head_dim, self.dtype,
                              self.device)
        # RADIXLM_DEBUG_KV=1 (the test suite sets it): double frees raise, and the scheduler checks
        # the pool's accounting and the radix tree whenever it goes idle
        self.allocator = SlotAllocator(num_slots, debug=os.environ.get(DEBUG_KV_ENV) == "1")
        self.req_to_token = ReqToTokenPool(args.max_running_requests + 8, self.context_len + 1, self.device,
                                           dummy_slot=self.kv_pool.dummy_slot)
        slot_bytes = KVPool.bytes_per_slot(cfg.num_hidden_layers, self.num_kv_heads, self.head_dim, self.dtype)
        mapped = mapped_weight_bytes(self.model)
        host_memory.return_freed_memory()  # what loading freed on the host (host_memory.py)
        logger.info(
            "loaded %s: %s, %.1fM params, weights %.0f MiB resident%s, %s on %s, %s attention, %s matmuls; "
            "KV pool %d tokens (%.0f MiB%s), context %d, %.1fs",
            args.model, type(self.model).__name__, self.num_params / 1e6, weight_bytes / 2**20,
            f" (+{mapped / 2**20:.0f} MiB of token embeddings mapped, paged in as looked up)" if mapped else "",
            str(self.dtype).removeprefix("torch."), self.device, self.attn_backend.name,
            self.matmuls, num_slots, num_slots * slot_bytes / 2**20,
            ", paged in as written" if self.device.type == "cpu" else "", self.context_len, time.perf_counter() - start,
        )
        logger.info("model source: %s", source.description)
        # after the KV pool: the graphs' memory comes from what the pool left (and their padding
        # rows write its dummy slot)
        self.graph_runner = graph_runner_for(self.model, self.attn_backend, self.kv_pool, self.req_to_token,
                                             self.device, args.disable_cuda_graph, args.graph_max_bs)
        self.compiled = self._compile() if args.enable_torch_compile else None
        # the team sized to the cores other processes leave free (cpu/contention.py); a deterministic
        # run keeps the count it started with
        cpu = self.device.type == "cpu" and not args.enable_deterministic_inference
        self.governor = ThreadGovernor.for_this_machine() if cpu else None

    def _compile(self) -> CompiledForward | None:
        if self.device.type != "cpu":
            logger.warning("--enable-torch-compile compiles the CPU forward only (CUDA decodes replay graphs); "
                           "the forward runs eagerly on %s", self.device)
            return None
        if not getattr(self.model, "compile_safe", True):
            raise ValueError(f"--enable-torch-compile: {type(self.model).__name__} reads the step's sizes on the host "
                             "(routed experts, sliding windows), which one compiled graph cannot hold; start without "
                             "the flag")
        use_cache_dir(default_cache_dir())
        compiled = CompiledForward(self.model, self.attn_backend)
        try:
            seconds = compiled.warm_up(self.device)
        except Exception as e:  # inductor needs a C++ compiler, among others: say so, no silent eager run
            why = f"{type(e).__name__}: {str(e).strip()[:300]}"
            raise RuntimeError(f"--enable-torch-compile: torch.compile could not compile the model ({why}); "
                               "start without the flag to run it eagerly") from e
        logger.info("forward compiled by torch.compile (inductor, one graph for every batch) in %.1fs", seconds)
        return compiled

    def _deterministic_rows(self, args, float_matmuls: bool) -> int:
        """Rows every float matmul runs on at least: 2 under --enable-deterministic-inference, where
        oneDNN gives a row the same bits in any batch from 2 rows on (int8 matmuls are exact per row)."""
        if not (args.enable_deterministic_inference and float_matmuls):
            return 1
        if self.gemm != "onednn" or not rows_invariant():
            raise ValueError("--enable-deterministic-inference needs float32 matmuls whose rows do not depend on "
                             "the batch (oneDNN's, checked at start-up), which this machine lacks with "
                             f"the {self.gemm} kernel; use --quantization int8 (or RADIXLM_CPU_GEMM=onednn)")
        return 2

    def _kv_pool_size(self, args: EngineArgs, weight_bytes: int) -> int:
        cfg = self.config
        per_slot = KVPool.bytes_per_slot(cfg.num_hidden_layers, self.num_kv_heads, self.head_dim, self.dtype)
        available = host_memory.available_bytes() if self.device.type == "cpu" else None
        if args.max_total_tokens is not None:
            slots = args.max_total_tokens
        else:
            if args.kv_memory_gb is not None:
                budget = args.kv_memory_gb * 2**30
            elif self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = free * CUDA_KV_FRACTION
                if args.mem_fraction_static is not None:  # SGLang's: weights + KV within this share of all memory
                    budget = free - total * (1 - args.mem_fraction_static)
            else:
                budget = DEFAULT_CPU_KV_GB * 2**30
                if available is not None and budget > available * CPU_KV_AVAILABLE_SHARE:
                    budget = available * CPU_KV_AVAILABLE_SHARE
                    logger.info("KV pool cut to %.2f GiB: %.0f%% of the %.2f GiB of memory available",
                                budget / 2**30, 100 * CPU_KV_AVAILABLE_SHARE, available / 2**30)
            slots = max(int(budget // per_slot), 256)
        # the CPU pool is mapped lazily (host_memory): one that cannot fit would only fail once it filled
        if available is not None and slots * per_slot > available:
            raise ValueError(f"a KV pool of {slots} tokens needs {slots * per_slot / 2**30:.2f} GiB, more than the "
                             f"{available / 2**30:.2f} GiB of memory available; lower --max-total-tokens "
                             "or --kv-memory-gb")
        return slots

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (float32) of the batch's logits_indices rows; decode batches that fit a recorded
        bucket replay its graph."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        if self.governor is not None:
            self.governor.check()
        self.attn_backend.init_forward_metadata(batch)
        if self.compiled is not None:
            return self.compiled(batch).float()
        return self.model(batch).float()

    def make_batch(self, plan: BatchPlan) -> ForwardBatch:
        return ForwardBatch.build(plan, self.req_to_token, self.kv_pool, self.device)
