"""The attention backend interface every model layer calls."""

from __future__ import annotations

import abc

import torch

from radixlm.runtime.forward_batch import ForwardBatch, ForwardMode


class AttentionBackend(abc.ABC):
    """Stores the new K/V into the pool and attends over each request's full sequence.

    `init_forward_metadata` runs once per forward pass (index tensors, masks) so the per-layer
    calls only do tensor work.
    """

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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for the new tokens -> [T, H, D]."""
        batch.kv_pool.write(layer, batch.out_cache_loc, k, v)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)
