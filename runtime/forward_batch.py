"""The per-step context a model forward pass reads (filled by ModelRunner, read by attention)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from radixlm.runtime.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # new tokens (a prompt or a chunk of one) after an optional cached prefix
    DECODE = "decode"  # exactly one new token per request


@dataclass(slots=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] new tokens of all requests, concatenated
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] slot that receives each new token's K/V
    kv_indices: list[torch.Tensor]  # per request: slots of all its tokens (prefix + new), in order
    seq_lens: list[int]  # per request: total length after this pass
    extend_lens: list[int]  # per request: number of new tokens (1 in decode)
    logits_indices: torch.Tensor  # rows of the [T, hidden] output to turn into logits
    kv_pool: KVPool
    attn_metadata: Any = None  # filled by the attention backend's init_forward_metadata

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)
