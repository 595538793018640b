"""The `triton` attention backend: our own kernels (triton_kernels.py) over the page-size-1 KV pool.

The default on GPUs FlashInfer does not support, and what runs where FlashInfer is not installed.
Both kernels read each request's slots straight from the req->token table (rows and lengths are
the only per-step metadata; the batch's CSR `kv_indices` is never built): decode splits long
sequences across programs (flash-decoding), extend reads prefix and new keys alike, since
`forward` has written the new K/V to the pool before the kernel runs. A batch-wide shared prefix
is read once per request, not once per batch: there is no cascade pass here.

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
    splits: int  # key splits per (request, KV head)
    mid_o: torch.Tensor | None  # [B, H, splits, D] float32 partial outputs (splits > 1)
    mid_lse: torch.Tensor | None  # [B, H, splits] float32 partial log2-sum-exp (splits > 1)


@dataclass(slots=True)
class _ExtendMeta:
    max_extend: int  # the batch's longest run of new tokens: sizes the grid


@dataclass(slots=True)
class _GraphState:
    """Static buffers for the largest bucket; a bucket of bs requests uses their leading part."""

    rows: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs]
    mid_o: torch.Tensor  # flat, room for [max_bs, H, MAX_SPLITS, D]
    mid_lse: torch.Tensor  # flat, room for [max_bs, H, MAX_SPLITS]
    max_context: int  # the length bound every bucket's split count is planned for
    table_ptr: int | None = None  # the req->token table the captured graphs read


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_graphs = True
    graph_exact = True  # split counts and reductions follow each row's length, not the table width

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

    # ---------------------------------------------------------------- planning
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.seq_lens.device
        _check_runnable(device)
        if batch.mode is ForwardMode.DECODE:
            bs = batch.batch_size
            splits = kernels.num_splits(bs, self.num_kv_heads, max(batch.seq_lens_host), device)
            mid_o = mid_lse = None
            if splits > 1:
                mid_o = torch.empty((bs, self.num_heads, splits, self.head_dim), dtype=torch.float32, device=device)
                mid_lse = torch.empty((bs, self.num_heads, splits), dtype=torch.float32, device=device)
            batch.attn_metadata = _DecodeMeta(batch.req_rows, batch.seq_lens, batch.req_to_token, splits, mid_o,
                                              mid_lse)
            return
        batch.attn_metadata = _ExtendMeta(max(batch.extend_lens_host))

    # ---------------------------------------------------------------- forward
    def forward_decode(self, q, k, v, layer, batch):
        meta: _DecodeMeta = batch.attn_metadata
        q = _dense_rows(q)
        out = torch.empty_like(q)
        kernels.decode(q, batch.kv_pool.k[layer], batch.kv_pool.v[layer], out, meta.table, meta.rows,
                       meta.seq_lens, meta.splits, meta.mid_o, meta.mid_lse, self.scale)
        return out

    def forward_extend(self, q, k, v, layer, batch):
        meta: _ExtendMeta = batch.attn_metadata
        q = _dense_rows(q)
        out = torch.empty_like(q)
        kernels.extend(q, batch.kv_pool.k[layer], batch.kv_pool.v[layer], out, batch.qo_indptr, batch.req_to_token,
                       batch.req_rows, batch.seq_lens, meta.max_extend, self.scale)
        return out

    # ---------------------------------------------------------------- CUDA-graph hooks
    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        _check_runnable(device)
        h, d, s = self.num_heads, self.head_dim, kernels.MAX_SPLITS
        self._graph = _GraphState(
            rows=torch.zeros(max_bs, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int64, device=device),
            mid_o=torch.empty(max_bs * h * s * d, dtype=torch.float32, device=device),
            mid_lse=torch.empty(max_bs * h * s, dtype=torch.float32, device=device),
            max_context=max_context,
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Rewrites the bucket's rows and lengths in place; the split count (so the grid) depends
        on the bucket's size and the length bound only, never on this step's lengths."""
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
        splits = kernels.num_splits(bs, self.num_kv_heads, g.max_context, rows.device)
        mid_o = g.mid_o[: bs * h * splits * d].view(bs, h, splits, d)
        mid_lse = g.mid_lse[: bs * h * splits].view(bs, h, splits)
        batch.attn_metadata = _DecodeMeta(rows, seq_lens, batch.req_to_token, splits, mid_o, mid_lse)


def _check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and not kernels.INTERPRET:
        raise RuntimeError(NEEDS_CUDA)


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels take strides for tokens and heads but assume each head's vector is contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()
