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
