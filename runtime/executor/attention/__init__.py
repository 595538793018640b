"""Attention backends behind one interface; imported lazily so CPU machines never load CUDA code."""

from __future__ import annotations

import importlib

from radixlm.runtime.executor.attention.base import AttentionBackend

_BACKENDS = {
    "torch": ("radixlm.runtime.executor.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("radixlm.runtime.executor.attention.triton_backend", "TritonAttentionBackend"),
    "invariant": ("radixlm.runtime.executor.attention.invariant_backend", "InvariantAttentionBackend"),
}


def resolve_backend_name(name: str, device_type: str, invariant: bool = False) -> str:
    """`auto`: our Triton kernels on CUDA (the FlashInfer backend is not built yet: it must run on
    a GPU before it can be a default); on the CPU the batch-invariant backend where answers must not
    depend on the batch (`invariant`: int8 activations round last-bit differences into other
    tokens), else the torch reference."""
    if invariant and device_type == "cuda":
        raise ValueError("deterministic (batch-invariant) inference is built for the CPU only; on CUDA drop "
                         "--enable-deterministic-inference")
    if name != "auto":
        return name
    if device_type == "cuda":
        return "triton"
    return "invariant" if invariant else "torch"


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    """`kwargs`: num_heads, num_kv_heads, head_dim and optionally device (the backend's tensors')."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)} or auto")
    module, cls = _BACKENDS[name]
    if name in ("torch", "invariant"):
        kwargs.pop("device", None)  # runs wherever its inputs are
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["AttentionBackend", "create_attention_backend", "resolve_backend_name"]
