"""How fast this machine reads memory: the bound a step that streams weights or logits cannot beat."""

from __future__ import annotations

import time

import torch


def read_speed() -> float:
    """GB/s of one float32 sum over 256 MiB on the calling thread's team (best of 5): larger than any
    cache, so it reads from memory as a weight stream or a cold logits tensor does."""
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
