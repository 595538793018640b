"""Token embeddings read from a GGUF's own Q8_0 rows, for the int4 and fp16 modes on a file that holds them so.

A Q8_0 row is blocks of 32 int8 values q, each block with an fp16 scale d: w = d * q, exact in
float32. The rows stay mapped from the file and a lookup widens only the rows it reads, so the
embeddings take no memory beyond the rows looked up (llama.cpp's `token_embd` the same way) and are
the file's values exactly, where the fp16 copy they replace rounds them (Fp16Embedding). A tied
lm_head keeps its packed fp16 copy (cpu/fp16.py): torch has no product over Q8_0 blocks.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from radixlm.runtime.executor.cpu.int4 import gguf_source
from radixlm.runtime.executor.gguf_tensors import BLOCKS, LLAMA_LAYOUT, read_gguf

_VALUES, _BYTES = BLOCKS["Q8_0"]  # 32 values in 34 bytes: the fp16 scale, then the int8 values


class GgufQ8Embedding(nn.Module):
    def __init__(self, rows: torch.Tensor, dim: int, source: str):
        """rows: uint8 [vocab, dim / 32 * 34], the file's Q8_0 rows (mapped: never written)."""
        super().__init__()
        if dim % _VALUES or rows.dtype != torch.uint8 or rows.shape[1] != dim // _VALUES * _BYTES:
            raise ValueError(f"Q8_0 rows {tuple(rows.shape)} {rows.dtype} do not hold {dim} values a row")
        self.rows = rows
        self.dim = dim
        self.mapped_from = source

    @property
    def num_embeddings(self) -> int:
        return self.rows.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = self.rows[ids.reshape(-1)].view(-1, self.dim // _VALUES, _BYTES)
        scale = blocks[..., :2].contiguous().view(torch.float16).float()  # [n, blocks, 1]
        values = blocks[..., 2:].contiguous().view(torch.int8).float()  # [n, blocks, 32]
        return values.mul_(scale).view(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} x {self.dim}, Q8_0 rows mapped from {self.mapped_from}"


def map_file_embeddings(model: nn.Module, folder: Path) -> bool:
    """Replaces the model's token embeddings by its GGUF's Q8_0 rows, where the model was converted from
    a llama / qwen2 / qwen3 GGUF that holds them so (after `to_fp16`, which packs a tied lm_head from
    the embeddings it replaces); whether it did."""
    source = gguf_source(folder)
    embed = getattr(model, "embed_tokens", None)
    if source is None or embed is None:
        return False
    vocab, dim = embed.weight.shape
    q8 = q8_embedding(source, vocab, dim)
    if q8 is not None:
        model.embed_tokens = q8
    return q8 is not None


def q8_embedding(gguf: Path, vocab: int, dim: int) -> GgufQ8Embedding | None:
    """The token embeddings of `gguf` when it holds them as Q8_0 rows of that shape, else None."""
    arch, tensors = read_gguf(gguf)
    t = tensors.get("token_embd.weight")
    if arch not in LLAMA_LAYOUT or t is None or t.kind != "Q8_0" or t.shape != (dim, vocab):
        return None
    with warnings.catch_warnings():  # the file is mapped read-only and nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        rows = torch.from_numpy(t.data)
    return GgufQ8Embedding(rows, dim, str(gguf))
