"""Model registry keyed by the HF `architectures` name; modules are imported lazily."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "LlamaForCausalLM": ("radixlm.runtime.executor.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("radixlm.runtime.executor.models.llama", "Qwen2ForCausalLM"),
    "MistralForCausalLM": ("radixlm.runtime.executor.models.llama", "MistralForCausalLM"),
}


def get_model_class(config):
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) == "llama":
        archs = ["LlamaForCausalLM"]
    for arch in archs:
        if arch in _REGISTRY:
            module, name = _REGISTRY[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported architecture {archs or config.model_type!r}; supported: {sorted(_REGISTRY)}")

