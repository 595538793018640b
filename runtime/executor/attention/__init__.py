"""Attention backends behind one interface; imported lazily so CPU machines never load CUDA code."""

from __future__ import annotations

import importlib

from radixlm.runtime.executor.attention.base import AttentionBackend

_BACKENDS = {
    "torch": ("radixlm.runtime.executor.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("radixlm.runtime.executor.attention.triton_backend", "TritonAttentionBackend"),
}


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["AttentionBackend", "create_attention_backend"]
