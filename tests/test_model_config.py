"""The plain config read from config.json (executor/model_config.py) builds the same model as
transformers' own config class, and the tokenizer handed it is the one AutoTokenizer finds alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis_budget import examples

from radixlm.runtime.executor.loader import load_config, load_tokenizer
from radixlm.runtime.executor.model_config import STATED, model_config, tokenizer_config
from radixlm.runtime.executor.models import get_model_class

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# what a config.json may say beyond the stated fields, and values to say it with
OPTIONAL = {
    "head_dim": st.sampled_from([8, 16]),
    "hidden_act": st.just("silu"),
    "attention_bias": st.booleans(),
    "mlp_bias": st.booleans(),
    "rope_theta": st.sampled_from([10000.0, 500000.0]),
    "rope_scaling": st.sampled_from([None, {"type": "linear", "factor": 2.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}]),
    "rope_parameters": st.sampled_from([{"rope_type": "default", "rope_theta": 500000.0},
                                        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "rope_theta": 5e5, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}]),
    "eos_token_id": st.just([2, 7]),
    "architectures": st.none(),
}


def auto_config(folder):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder, local_files_only=True)


def model_view(config) -> dict:
    """Everything the runner and the model take from a config: the model's parameter shapes, its rope
    tables, norm eps, biases, and the runner's sizes."""
    model = get_model_class(config)(config, None, max_positions=128)
    heads = config.num_attention_heads
    return {
        "class": type(model).__name__,
        "shapes": {k: tuple(v.shape) for k, v in model.state_dict().items()},
        "rope": (model.rope.cos.clone(), model.rope.sin_signed.clone()),
        "eps": [m.eps for m in model.modules() if hasattr(m, "eps")],
        "tied": model.tie_word_embeddings,
        "context": getattr(config, "max_position_embeddings", 4096),
        "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "eos": getattr(config, "eos_token_id", None),
    }


def assert_same_view(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "rope":
            assert all(torch.equal(x, y) for x, y in zip(a[key], b[key], strict=True)), key
        else:
            assert a[key] == b[key], key


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(ARCHS)), optional=st.fixed_dictionaries({}, optional=OPTIONAL),
       tie=st.booleans(), eps=st.sampled_from([1e-5, 1e-6]), layers=st.integers(1, 3),
       kv_heads=st.sampled_from([1, 2, 4]))
def test_a_plain_config_builds_what_transformers_config_builds(tmp_path_factory, family, optional, tie, eps, layers,
                                                               kv_heads):
    data = {"model_type": family, "architectures": [ARCHS[family]], "vocab_size": 96, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": layers, "num_attention_heads": 4, "rms_norm_eps": eps,
            "max_position_embeddings": 128, "tie_word_embeddings": tie, "eos_token_id": 2,
            "num_key_value_heads": kv_heads, **optional}
    if data["architectures"] is None:  # a model type alone names the class
        del data["architectures"]
        if family != "llama":
            data["architectures"] = [ARCHS[family]]
    folder = tmp_path_factory.mktemp("config")
    (folder / "config.json").write_text(json.dumps(data))
    note(json.dumps(data))
    plain = model_config(folder)
    assert (plain is None) == ("rope_scaling" in data)  # the old form, even null, goes through transformers
    assert_same_view(model_view(load_config(folder)), model_view(auto_config(folder)))


@pytest.mark.parametrize("missing", STATED)
def test_a_config_without_a_stated_field_goes_through_transformers(tmp_path, missing):
    data = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": 5, "num_key_value_heads": 2}
    del data[missing]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert model_config(tmp_path) is None
    config = load_config(tmp_path)
    assert type(config).__name__ == "LlamaConfig"  # transformers' defaults fill the gap
    assert_same_view(model_view(config), model_view(auto_config(tmp_path)))


def test_other_model_types_and_broken_files_are_not_read_plainly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96}))
    assert model_config(tmp_path) is None
    (tmp_path / "config.json").write_text("[1, 2]")
    assert model_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert model_config(tmp_path) is None


def test_the_built_in_model_and_its_tokenizer_load_as_transformers_loads_them(smollm_folder):
    from transformers import AutoTokenizer

    assert tokenizer_config(smollm_folder) is not None  # the fast path is the one compared here
    from transformers import PretrainedConfig

    plain = load_config(smollm_folder)
    assert type(plain) is PretrainedConfig
    assert_same_view(model_view(plain), model_view(auto_config(smollm_folder)))
    ours = load_tokenizer(smollm_folder)
    theirs = AutoTokenizer.from_pretrained(smollm_folder, local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.chat_template == theirs.chat_template
    assert ours.special_tokens_map == theirs.special_tokens_map and ours.eos_token_id == theirs.eos_token_id
    chat = [{"role": "user", "content": "Hi there <|im_end|> ünïcode"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert ours("Hello world  \n\t x")["input_ids"] == theirs("Hello world  \n\t x")["input_ids"]


def test_loading_the_built_in_model_imports_no_model_config_module(smollm_folder):
    """What makes start-up 3 s shorter: neither the config nor the tokenizer pulls in transformers'
    per-model config module and, through it, torch.distributed.tensor and sympy."""
    code = (f"import sys; from radixlm.runtime.executor.loader import load_config, load_tokenizer; "
            f"load_config({str(smollm_folder)!r}); load_tokenizer({str(smollm_folder)!r}); "
            "print(sorted(m for m in sys.modules if m.startswith(('sympy', 'transformers.models.llama', "
            "'torch.distributed.tensor'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


@pytest.mark.parametrize("change", ["no class", "remote code", "no model type"])
def test_autotokenizer_loads_the_config_itself_where_its_class_could_matter(smollm_folder, tmp_path, change):
    import shutil

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_folder / name, tmp_path / name)
    config, declared = (json.loads((tmp_path / n).read_text()) for n in ("config.json", "tokenizer_config.json"))
    if change == "no class":
        del declared["tokenizer_class"]
    elif change == "remote code":
        declared["auto_map"] = {"AutoTokenizer": [None, "tok.Tok"]}
    else:
        del config["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(declared))
    assert tokenizer_config(tmp_path) is None
