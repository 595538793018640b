"""A model folder's `config.json` read without importing transformers' per-model config modules.

`AutoConfig.from_pretrained` imports the model's config module (`configuration_llama`), whose type
validators pull in `transformers.activations` and through it `torch.distributed.tensor` and sympy:
about a third of a small model's scheduler start, paid again in the HTTP and detokenizer
processes, because `AutoTokenizer` loads the config too, only to read its `model_type`. The config
itself is a few dozen JSON fields.

So a folder of a family these models implement (Llama, Mistral, Qwen2), whose `config.json` states
every field whose default differs between transformers' config classes and ours, and has no
`rope_scaling` key (transformers 5's base class takes it, even null, for its `rope_parameters`; its
model classes convert the old form), is read into
transformers' base `PretrainedConfig`: the JSON's own values as attributes, `dtype` as a torch dtype,
`to_dict` as usual. Fields it may leave out have the same default in transformers' classes and in
the model code (`head_dim` from the heads, `hidden_act` silu, no biases but Qwen2's q/k/v, rope
theta 10,000); tests/test_model_config.py builds both ways from configs hypothesis writes. Any other
folder goes through `AutoConfig`.
`AutoTokenizer` is handed a plain config too where its choice of class cannot depend on the config's
class (`tokenizer_config`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

# model types with the defaults described above (executor/models/llama.py implements all three)
FAMILIES = frozenset({"llama", "mistral", "qwen2"})
# fields whose default in transformers' config class is not what the model code would assume
STATED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "num_key_value_heads")


class HeadShape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int


def head_shape(config) -> HeadShape:
    """The attention heads a config describes: KV heads default to the query heads (no GQA), the head
    size to hidden_size / heads, as transformers' classes default them."""
    heads = config.num_attention_heads
    return HeadShape(heads, getattr(config, "num_key_value_heads", None) or heads,
                     getattr(config, "head_dim", None) or config.hidden_size // heads)


def sliding_window(config) -> int | None:
    """The attention window the config enables, in tokens (a query sees itself and the window - 1
    keys before it), or None. Qwen2/Qwen3 switch theirs on with `use_sliding_window`; Mistral,
    Mixtral and Phi-3 state one (or null)."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object file as a dict, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def plain_config(folder: str | os.PathLike, data: dict[str, Any]):
    """`data` (a config.json) as transformers' base `PretrainedConfig`, named after its folder."""
    from transformers import PretrainedConfig

    config = PretrainedConfig.from_dict(dict(data))
    config._name_or_path = os.fspath(folder)  # as AutoConfig.from_pretrained sets it
    return config


def model_config(folder: str | os.PathLike):
    """The plain config where it gives the model what transformers' class would, else None."""
    data = json_object(Path(folder) / "config.json")
    if data is None or data.get("model_type") not in FAMILIES or any(data.get(k) is None for k in STATED):
        return None
    if "rope_scaling" in data:  # transformers 5's base class takes it, even null, for its rope_parameters
        return None
    return plain_config(folder, data)


def tokenizer_config(folder: str | os.PathLike):
    """A plain config to hand `AutoTokenizer`, or None to let it load the config itself. It is handed
    one only where its choice cannot depend on the config's class: the tokenizer's own config names
    its class and brings no code, and config.json has a model type."""
    data, declared = (json_object(Path(folder) / name) for name in ("config.json", "tokenizer_config.json"))
    if data is None or not isinstance(data.get("model_type"), str) or declared is None:
        return None
    if not isinstance(declared.get("tokenizer_class"), str) or "auto_map" in declared:
        return None
    keep = ("model_type", "model_name", "tokenizer_class")  # all AutoTokenizer reads of a config here
    return plain_config(folder, {k: data[k] for k in keep if k in data})
