"""Sampling batches for the sampler's tests (tests/test_sampler.py, tests/test_sampler_distribution.py)."""

from __future__ import annotations

import torch

from radixlm.runtime.sampling.kernels import SamplingBatch

CPU = torch.device("cpu")


def make_batch(params, prompts=None, outputs=None, vocab=None, logits=None, seed=0):
    rows = len(params)
    vocab = vocab if vocab is not None else logits.shape[1]
    prompts = prompts if prompts is not None else [[] for _ in range(rows)]
    outputs = outputs if outputs is not None else [[] for _ in range(rows)]
    return SamplingBatch.build(
        params, prompts, outputs, vocab, CPU, generator=torch.Generator().manual_seed(seed)
    )


def pack(mask: torch.Tensor) -> torch.Tensor:
    """bool [B, V] -> the grammars' int32 bitmask [B, ceil(V / 32)] (bits past V allowed, as allocated)."""
    rows, vocab = mask.shape
    bits = torch.ones(rows, (vocab + 31) // 32 * 32, dtype=torch.int64)
    bits[:, :vocab] = mask.long()
    words = (bits.view(rows, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
