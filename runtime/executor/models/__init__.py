"""Model registry keyed by the HF `architectures` name; modules are imported lazily. This is the one
list of supported architectures (GGUF files convert through transformers to one of these)."""

from __future__ import annotations

import importlib

_REGISTRY = {
    "LlamaForCausalLM": ("radixlm.runtime.executor.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("radixlm.runtime.executor.models.llama", "Qwen2ForCausalLM"),
    "MistralForCausalLM": ("radixlm.runtime.executor.models.llama", "MistralForCausalLM"),
    "Qwen3ForCausalLM": ("radixlm.runtime.executor.models.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("radixlm.runtime.executor.models.llama", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("radixlm.runtime.executor.models.llama", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("radixlm.runtime.executor.models.llama", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("radixlm.runtime.executor.models.gemma3", "Gemma3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(config):
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) == "llama":
        archs = ["LlamaForCausalLM"]
    for arch in archs:
        if arch in _REGISTRY:
            module, name = _REGISTRY[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"unsupported architecture {archs or config.model_type!r}; supported: {supported_architectures()}")

