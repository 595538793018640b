"""Attention backends behind one interface; imported lazily so CPU machines never load CUDA code."""

from __future__ import annotations

import importlib

from radixlm.runtime.executor.attention.base import AttentionBackend

_BACKENDS = {
    "torch": ("radixlm.runtime.executor.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("radixlm.runtime.executor.attention.triton_backend", "TritonAttentionBackend"),
}


def resolve_backend_name(name: str, device_type: str) -> str:
    """`auto`: our Triton kernels on CUDA (the FlashInfer backend is not built yet: it must run on
    a GPU before it can be a default), the torch reference elsewhere."""
    if name != "auto":
        return name
    return "triton" if device_type == "cuda" else "torch"


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    """`kwargs`: num_heads, num_kv_heads, head_dim and optionally device (the backend's tensors')."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)} or auto")
    module, cls = _BACKENDS[name]
    if name == "torch":
        kwargs.pop("device", None)  # runs wherever its inputs are
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["AttentionBackend", "create_attention_backend", "resolve_backend_name"]
