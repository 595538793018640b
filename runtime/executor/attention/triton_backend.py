"""The `triton` attention backend: our own kernels (triton_kernels.py) over the page-size-1 KV pool.

The default on GPUs FlashInfer does not support, and what runs where FlashInfer is not installed.
Both kernels read each request's slots straight from the req->token table (rows and lengths are
the only per-step metadata; the batch's CSR `kv_indices` is never built): decode splits long
sequences across programs (flash-decoding), extend reads prefix and new keys alike, since
`forward` has written the new K/V to the pool before the kernel runs. A decode batch whose
requests share a cached prefix (`batch.shared_prefix_len`: few-shot prompts, forks, n > 1) reads it
once per batch, in a cascade pass beside the per-request one; captured graphs always plan that pass
(the shared length is a device scalar rewritten per replay, 0 when nothing is shared). An extend
reads a shared prefix once per request: its queries are many, so its keys' bytes weigh less.

On the CPU the kernels run only under triton's interpreter (`TRITON_INTERPRET=1` set before triton
is imported), which is how the tests check them against the torch backend on machines without a
GPU. Importing this module imports triton; the backend registry imports it only when chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.runtime.executor.attention import triton_kernels as kernels
from radixlm.runtime.executor.attention.base import AttentionBackend
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode

NEEDS_CUDA = "the triton backend needs CUDA, or TRITON_INTERPRET=1 to run its kernels on the CPU for tests"


@dataclass(slots=True)
class _DecodeMeta:
    rows: torch.Tensor  # [B] req->token table row of each request
    seq_lens: torch.Tensor  # [B] keys of each request (its new token included)
    table: torch.Tensor  # the req->token table
    shared_len: torch.Tensor  # [1] leading keys every request shares (the cascade's; 0 = none)
    splits: int  # key splits per (request, KV head) after the shared keys
    shared_splits: int  # splits of the shared keys per (row block, KV head); 0 = no cascade pass
    mid_o: torch.Tensor | None  # [B, H, splits + shared_splits, D] float32 partial outputs (more than one)
    mid_lse: torch.Tensor | None  # [B, H, splits + shared_splits] float32 partial log2-sum-exp


@dataclass(slots=True)
class _ExtendMeta:
    max_extend: int  # the batch's longest run of new tokens: sizes the grid


@dataclass(slots=True)
class _GraphState:
    """Static buffers for the largest bucket; a bucket of bs requests uses their leading part."""

    rows: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs]
    shared_len: torch.Tensor  # [1]
    mid_o: torch.Tensor  # flat, room for [max_bs, H, 2 * MAX_SPLITS, D]
    mid_lse: torch.Tensor  # flat, room for [max_bs, H, 2 * MAX_SPLITS]
    max_context: int  # the length bound every bucket's split count is planned for
    table_ptr: int | None = None  # the req->token table the captured graphs read


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_graphs = True
    supports_window = True
    graph_exact = True  # a row's splits and their merge follow its length alone (triton_kernels)
    reads_pool_only = True  # forward_decode / forward_extend read K/V from the pool only

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 device: torch.device | str | None = None):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        _check_runnable(torch.device(device))
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self._graph: _GraphState | None = None
        self._no_shared: torch.Tensor | None = None  # [1] zero: the start of a decode without a cascade

    # ---------------------------------------------------------------- planning
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        _check_runnable(device)
        if batch.mode is ForwardMode.DECODE:
            bs, p = batch.batch_size, batch.shared_prefix_len
            splits = kernels.num_splits(max(batch.seq_lens_host) - p)
            shared_splits = kernels.num_splits(p) if p else 0
            total = splits + shared_splits
            mid_o = mid_lse = None
            if total > 1:
                mid_o = torch.empty((bs, self.num_heads, total, self.head_dim), dtype=torch.float32, device=device)
                mid_lse = torch.empty((bs, self.num_heads, total), dtype=torch.float32, device=device)
            if p:
                start = torch.full((1,), p, dtype=torch.int64, device=device)
            else:
                if self._no_shared is None or self._no_shared.device != device:
                    self._no_shared = torch.zeros(1, dtype=torch.int64, device=device)
                start = self._no_shared
            batch.attn_metadata = _DecodeMeta(batch.req_rows, batch.seq_lens, batch.req_to_token, start, splits,
                                              shared_splits, mid_o, mid_lse)
            return
        batch.attn_metadata = _ExtendMeta(max(batch.extend_lens_host))

    # ---------------------------------------------------------------- forward
    def forward_decode(self, q, k, v, layer, batch, window: int = 0):
        meta: _DecodeMeta = batch.attn_metadata
        q = _dense_rows(q)
        out = torch.empty_like(q)
        kernels.decode(q, batch.kv_pool.k[layer], batch.kv_pool.v[layer], out, meta.table, meta.rows,
                       meta.seq_lens, meta.shared_len, meta.splits, meta.shared_splits, meta.mid_o, meta.mid_lse,
                       self.scale, window)
        return out

    def forward_extend(self, q, k, v, layer, batch, window: int = 0):
        meta: _ExtendMeta = batch.attn_metadata
        q = _dense_rows(q)
        out = torch.empty_like(q)
        kernels.extend(q, batch.kv_pool.k[layer], batch.kv_pool.v[layer], out, batch.qo_indptr, batch.req_to_token,
                       batch.req_rows, batch.seq_lens, meta.max_extend, self.scale, window)
        return out

    # ---------------------------------------------------------------- CUDA-graph hooks
    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        _check_runnable(device)
        h, d, s = self.num_heads, self.head_dim, kernels.MAX_SPLITS
        self._graph = _GraphState(
            rows=torch.zeros(max_bs, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int64, device=device),
            shared_len=torch.zeros(1, dtype=torch.int64, device=device),
            mid_o=torch.empty(max_bs * h * 2 * s * d, dtype=torch.float32, device=device),
            mid_lse=torch.empty(max_bs * h * 2 * s, dtype=torch.float32, device=device),
            max_context=max_context,
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Rewrites the bucket's rows, lengths and shared length in place; the grids are planned for
        the length bound, never this step's lengths (the programs past a row's splits exit). The
        cascade pass is always in the graph: with nothing shared its programs see no keys."""
        g = self._graph
        if g is None:
            raise RuntimeError("init_graph_state must run before capture/replay")
        ptr = batch.req_to_token.data_ptr()
        if g.table_ptr is None:
            g.table_ptr = ptr
        elif g.table_ptr != ptr:
            raise RuntimeError("the req->token table moved since the graphs were captured")
        bs, h, d = batch.batch_size, self.num_heads, self.head_dim
        if bs > g.rows.numel():
            raise ValueError(f"batch of {bs} exceeds the graph state's {g.rows.numel()} requests")
        rows, seq_lens = g.rows[:bs], g.seq_lens[:bs]
        rows.copy_(batch.req_rows)
        seq_lens.copy_(batch.seq_lens)
        g.shared_len.fill_(batch.shared_prefix_len)
        splits = kernels.num_splits(g.max_context)
        total = 2 * splits
        mid_o = g.mid_o[: bs * h * total * d].view(bs, h, total, d)
        mid_lse = g.mid_lse[: bs * h * total].view(bs, h, total)
        batch.attn_metadata = _DecodeMeta(rows, seq_lens, batch.req_to_token, g.shared_len, splits, total - splits,
                                          mid_o, mid_lse)


def _check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and not kernels.INTERPRET:
        raise RuntimeError(NEEDS_CUDA)


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels take strides for tokens and heads but assume each head's vector is contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()
