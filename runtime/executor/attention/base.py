"""The attention backend interface every model layer calls.

Per step the model runner calls `init_forward_metadata(batch)` once: the backend plans from the
flat ForwardBatch (index tensors, masks, kernel plans) so the per-layer `forward_extend` /
`forward_decode` calls only do tensor work.

CUDA graphs replay a decode step recorded once per batch-size bucket, so everything a layer reads
must live in tensors whose storage never changes. The graph hooks give a backend that shape:
`init_graph_state` allocates static buffers for the largest bucket, `init_forward_metadata_capture`
plans a bucket's batch into (views of) them before recording, and `init_forward_metadata_replay`
rewrites them in place with the next step's values before a replay. A backend that cannot be
recorded says so with `supports_graphs = False`; one whose captured plan gives other bits than its
eager plan (`graph_exact = False`) keeps the hooks for the CPU's eager twin but is not recorded on
CUDA, so that graphs never change an answer.
"""

from __future__ import annotations

import abc

import torch

from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode


class AttentionBackend(abc.ABC):
    """Stores the new K/V into the pool and attends over each request's full sequence."""

    name: str = ""
    supports_graphs: bool = False
    # `forward(..., window=W)`: a query sees only the last W keys (sliding-window layers), with no read of
    # the step's lengths on the host; forward_decode / forward_extend then take `window` too
    supports_window: bool = False
    graph_exact: bool = False  # a replayed decode gives the eager decode's bits
    # attends from the pool alone: a model may write the step's K/V itself and call `forward(...,
    # stored=True)` (models/triton_layer_ops.rope_store)
    reads_pool_only: bool = False

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abc.abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch,
        window: int | None = None, stored: bool = False,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens -> [T, H, D]; ``stored``: the caller has
        written them to the pool already (k and v are then not read)."""
        if window is not None and not self.supports_window:
            raise NotImplementedError(f"attention backend {self.name!r} has no sliding windows")
        if stored and not self.reads_pool_only:
            raise ValueError(f"attention backend {self.name!r} reads the step's K/V, not only the pool")
        if not stored:
            batch.kv_pool.write(layer, batch.out_cache_loc, k, v)
        args = (q, k, v, layer, batch) if window is None else (q, k, v, layer, batch, window)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(*args)
        return self.forward_extend(*args)

    def set_gemm(self, gemm: str) -> None:
        """The CPU matmul kernel the model runs on ('onednn' or 'torch', models/linear.py); a backend
        doing matmuls of its own may follow it."""
        return None  # nothing to follow by default

    def set_bf16_extends(self, on: bool) -> None:
        """The model's matmuls round their rows to bfloat16 on a CPU with bfloat16 dot products
        (int4): a backend may attend long extend rows in bfloat16 too."""
        return None

    # ---------------------------------------------------------------- CUDA-graph hooks (decode)
    def init_graph_state(self, max_bs: int, max_context: int, device: torch.device) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be recorded in a graph")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be recorded in a graph")

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be recorded in a graph")
