"""Decode steps as CUDA-graph replays at bucketed batch sizes, and the CPU twin of the same runner.

A decode step of a small model is mostly kernel launches: a graph recorded once per batch size
replays the whole forward in one launch. Graphs fix every tensor's address and shape, so:

- Buckets: batch sizes 1, 2, 4, 8, then every 8 up to 64, then every 16, up to `max_bs`
  (`--cuda-graph-max-bs`); a batch of b rows runs in the smallest bucket >= b. Bigger batches and
  extend batches run the plain forward.
- Static buffers sized for the largest bucket hold what the model and the attention backend read
  (input_ids, positions, out_cache_loc, req_rows, prefix/seq lens, indptrs, logits_indices); each
  bucket's ForwardBatch is made of views of them, once. The backend keeps its own static state
  (`init_graph_state`) and rewrites it in place before each replay (`init_forward_metadata_replay`).
- Padding: rows b..bucket-1 get token 0 at position 0, write their K/V to the pool's dummy slot and
  attend through the dummy req->token row (seq_len 1, every entry the dummy slot), so they never
  touch a request's KV; their logits are dropped.
- Recording (CUDA): every bucket at start-up, largest first, all sharing one memory pool, each after
  a warm-up run (lazy kernel and workspace setup must not happen inside a capture).

With `record=False` the very same runner "replays" by running the model eagerly on the static
buffers: that is how the CPU tests check buffers, buckets and padding against the plain forward.
The engine uses it on CUDA only (the CPU forward stays as it is), with graphs recorded or, under
`--disable-cuda-graph`, eagerly: a matmul's row can get other bits in another number of rows, so
graphs off pads decode to the same buckets and computes what graphs on does, bit for bit.
RADIXLM_CUDA_GRAPH_EAGER=1 turns the eager twin on for any device (tests, and debugging a graph
on a GPU without recording).

A graph-capable backend's layers read only what its hooks planned (`batch.attn_metadata`) and the
static tensors. `kv_indices` changes size from step to step: its hooks (which run outside the graph)
may build it from the padded static rows, the recorded forward must not read it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time

import torch

from radixlm.runtime.executor.attention.base import AttentionBackend
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.executor.kv_pool import KVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

EAGER_ENV = "RADIXLM_CUDA_GRAPH_EAGER"
# rows of the [6, max_bs] buffer, in this order; padding rows take the values in _pad_values
FIELDS = ("input_ids", "positions", "out_cache_loc", "req_rows", "prefix_lens", "seq_lens")


def graph_buckets(max_bs: int) -> list[int]:
    """Recorded batch sizes: 1, 2, 4, 8, every 8 up to 64, every 16 after, and max_bs itself. A
    batch pads by at most 7 rows (15 past 64): small next to what a decode step reads anyway (the
    weights), and each bucket costs start-up time and graph memory."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_bs + 1, 16)]
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


class CudaGraphRunner:
    """Runs decode batches of up to `max_bs` rows through per-bucket graphs (or eagerly, `record=False`)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, kv_pool: KVPool,
                 req_to_token: ReqToTokenPool, max_bs: int, device: torch.device, record: bool):
        if not backend.supports_graphs:
            raise ValueError(f"attention backend {backend.name!r} cannot be recorded in a graph")
        if record and device.type != "cuda":
            raise ValueError("recording CUDA graphs needs a CUDA device (record=False runs the eager twin)")
        self.model, self.backend, self.kv_pool, self.req_to_token = model, backend, kv_pool, req_to_token
        self.device, self.record = device, record
        self.buckets = graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.replays = 0  # decode steps this runner ran (tests read it)
        n = self.max_bs
        self._ints = torch.zeros((len(FIELDS), n), dtype=torch.int64, device=device)
        pad = {"out_cache_loc": kv_pool.dummy_slot, "req_rows": req_to_token.dummy_row, "seq_lens": 1}
        self._pad_values = torch.tensor([[pad.get(f, 0)] * n for f in FIELDS], dtype=torch.int64, device=device)
        self._arange = torch.arange(n + 1, dtype=torch.int64, device=device)  # qo_indptr and logits_indices
        self._kv_indptr = torch.zeros(n + 1, dtype=torch.int64, device=device)
        backend.init_graph_state(n, req_to_token.max_context, device)
        self._batches = {bs: self._static_batch(bs) for bs in self.buckets}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # each graph's logits, rewritten by its replays
        if record:
            self._record_all()

    def can_run(self, batch: ForwardBatch) -> bool:
        """Decode with one logits row per request (as the scheduler builds them) and a bucket that fits."""
        b = batch.batch_size
        return batch.mode is ForwardMode.DECODE and b <= self.max_bs and batch.logits_indices.numel() == b

    def bucket_for(self, b: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, b)]

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's float32 logits [b, vocab]; a fresh tensor (the graph's output is rewritten by
        the next replay, while an overlapped step may still be reading this one)."""
        b = batch.batch_size
        bs = self.bucket_for(b)
        static = self._load(batch, bs)
        self.backend.init_forward_metadata_replay(static)
        if self.record:
            self._graphs[bs].replay()
            out = self._outputs[bs]
        else:
            out = self.model(static)
        self.replays += 1
        return out[:b].to(torch.float32, copy=True)

    # ---------------------------------------------------------------- buffers
    def _static_batch(self, bs: int) -> ForwardBatch:
        """Bucket bs's batch: views of the static buffers, all rows padding until a replay loads one."""
        self._ints[:, :bs].copy_(self._pad_values[:, :bs])
        self._kv_indptr[: bs + 1].copy_(self._arange[: bs + 1])  # each padding row: one key
        views = {f: self._ints[i, :bs] for i, f in enumerate(FIELDS)}
        return ForwardBatch(
            mode=ForwardMode.DECODE, **views, qo_indptr=self._arange[: bs + 1], kv_indptr=self._kv_indptr[: bs + 1],
            logits_indices=self._arange[:bs], seq_lens_host=[1] * bs, extend_lens_host=[1] * bs,
            shared_prefix_len=0, kv_pool=self.kv_pool, req_to_token=self.req_to_token.device_table,
        )

    def _load(self, batch: ForwardBatch, bs: int) -> ForwardBatch:
        """Copies the live batch into rows [0, b) of bucket bs's buffers (device to device, in
        place) and resets rows [b, bs) to padding: a bigger batch may have left its rows there.
        Returns the bucket's batch with this step's host values (the same device views)."""
        b, pad = batch.batch_size, bs - batch.batch_size
        for i, name in enumerate(FIELDS):
            self._ints[i, :b].copy_(getattr(batch, name))
        self._kv_indptr[: b + 1].copy_(batch.kv_indptr)
        if pad:
            self._ints[:, b:bs].copy_(self._pad_values[:, :pad])
            torch.add(self._arange[1 : pad + 1], batch.kv_indptr[b], out=self._kv_indptr[b + 1 : bs + 1])
        # a shallow copy, so nothing the last step's hooks cached on the batch is reused
        return dataclasses.replace(self._batches[bs], seq_lens_host=batch.seq_lens_host + [1] * pad,
                                   shared_prefix_len=batch.shared_prefix_len)

    # ---------------------------------------------------------------- recording (CUDA)
    def _record_all(self) -> None:
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):  # the largest first: smaller graphs fit in the memory it pooled
            static = dataclasses.replace(self._batches[bs])  # the template stays free of what hooks cache
            self.backend.init_forward_metadata_capture(static)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.model(static)  # warm-up: cuBLAS handles, workspaces and lazy inits outside the capture
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bs] = self.model(static)
            self._graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("recorded %d decode CUDA graphs (batch sizes %d..%d) in %.1fs, %.0f MiB",
                    len(self.buckets), self.buckets[0], self.max_bs, time.perf_counter() - start, used / 2**20)


def graph_runner_for(model: torch.nn.Module, backend: AttentionBackend, kv_pool: KVPool,
                     req_to_token: ReqToTokenPool, device: torch.device, disable: bool,
                     max_bs: int) -> CudaGraphRunner | None:
    """The engine's runner: recorded on CUDA; the eager twin anywhere with RADIXLM_CUDA_GRAPH_EAGER=1,
    and on CUDA with graphs disabled where they would be recorded (decode still pads to the buckets:
    a matmul's rows can get other bits in another shape, so graphs on or off computes the same
    answers); None on the CPU otherwise (its forward is unchanged), or when the model or the backend
    cannot be recorded."""
    eager = os.environ.get(EAGER_ENV) == "1"
    if device.type != "cuda" and (disable or not eager):
        return None
    if not eager and not getattr(model, "graph_safe", True):
        logger.info("CUDA graphs off: %s reads the step's sizes on the host (sliding windows on a backend "
                    "without them)", type(model).__name__)
        return None
    if not backend.supports_graphs:
        logger.info("CUDA graphs off: attention backend %r cannot be recorded", backend.name)
        return None
    if not eager and not backend.graph_exact:
        logger.info("CUDA graphs off: attention backend %r would give other bits recorded than eager", backend.name)
        return None
    record = not (eager or disable)
    if eager:
        logger.info("decode runs through the graph runner's eager twin (%s=1): no recording", EAGER_ENV)
    elif disable:
        logger.info("CUDA graphs disabled: decode runs eagerly, padded to the graph buckets all the same")
    try:
        return CudaGraphRunner(model, backend, kv_pool, req_to_token, max_bs, device, record=record)
    except RuntimeError as e:  # an op that syncs with the host cannot be captured: decode runs eager
        if not record:
            raise
        logger.warning("CUDA graphs off: recording %s's decode failed (%s)", type(model).__name__,
                       str(e).strip()[:300])
        return None
