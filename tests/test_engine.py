"""Engine end to end on SmolLM2: greedy output equals transformers `generate`, with the cache
cold and warm, with a pool so small that eviction and retraction happen, and with chunked
prefill; nothing leaks."""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_cold_and_warm_equal

from radixlm.runtime import Engine

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is 2+2?",
    "Name three colors.",
    "Write a haiku about rain.",
    "What is the capital of France? Answer in one word.",
    "Explain recursion to a child in two sentences.",
    "List the planets of the solar system.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Give a long and detailed explanation with examples.",
    "hi",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts(tokenizer):
    msgs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in msgs]


@pytest.fixture(scope="module")
def reference(prompts, hf_smollm, tokenizer):
    """transformers greedy generate, one prompt at a time (no padding effects)."""
    out = []
    for p in prompts:
        ids = torch.tensor([tokenizer(p).input_ids])
        with torch.no_grad():
            gen = hf_smollm.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=2,
                                     pad_token_id=2)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW}


@pytest.fixture(scope="module")
def reference_of(hf_smollm, tokenizer):
    def greedy(texts: list[str], max_new: int) -> list[list[int]]:
        out = []
        for text in texts:
            ids = torch.tensor([tokenizer(text).input_ids])
            with torch.no_grad():
                gen = hf_smollm.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=2, pad_token_id=2)
            out.append(gen[0, ids.shape[1]:].tolist())
        return out
    return greedy


def assert_idle(engine: Engine) -> None:
    info = engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["cache"]["protected_size"] == 0, "a finished request still locks cache nodes"
    assert info["free_slots"] + info["cache"]["evictable_size"] == info["max_total_tokens"]
    assert info["kv_check"] == "ok", info["kv_check"]
    assert engine.flush_cache()
    assert engine.get_server_info()["free_slots"] == info["max_total_tokens"], "KV slots leaked"


def test_greedy_equals_transformers_cold_and_warm(engine, prompts, reference):
    assert_cold_and_warm_equal(engine, prompts, GREEDY, reference)
    assert_idle(engine)


def test_small_pool_evicts_and_retracts_without_changing_answers(smollm_folder, prompts, reference):
    # 9 requests x ~60 tokens need ~600 slots; 200 forces retraction, and warm reruns force eviction
    with Engine(model=str(smollm_folder), quantization="none", max_total_tokens=200, chunked_prefill_size=64,
                log_level="warning") as e:
        for _ in range(2):
            out = e.generate(prompts, GREEDY)
            assert [o["output_ids"] for o in out] == reference
        info = e.get_server_info()
        assert info["retractions"] > 0, "the pool was meant to be too small for the batch"
        assert_idle(e)


def test_chunked_prefill_and_fcfs_give_same_answers(smollm_folder, prompts, reference):
    with Engine(model=str(smollm_folder), quantization="none", max_total_tokens=4096, chunked_prefill_size=7,
                schedule_policy="fcfs", log_level="warning") as e:
        out = e.generate(prompts, GREEDY)
        assert [o["output_ids"] for o in out] == reference
        assert_idle(e)


def test_cache_disabled_same_answers_no_hits(smollm_folder, prompts, reference):
    with Engine(model=str(smollm_folder), quantization="none", max_total_tokens=4096, disable_radix_cache=True,
                log_level="warning") as e:
        for _ in range(2):
            out = e.generate(prompts, GREEDY)
            assert [o["output_ids"] for o in out] == reference
            assert all(o["meta_info"]["cached_tokens"] == 0 for o in out)
        assert e.get_server_info()["free_slots"] == 4096


def test_concurrent_threads_batch_and_match(engine, prompts, reference):
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(engine.generate, p, GREEDY) for p in prompts]
        outs = [f.result(timeout=300) for f in futures]
    assert [o["output_ids"] for o in outs] == reference
    assert_idle(engine)


def test_flush_cache_also_forgets_tokenized_prompts(engine):
    """After a flush the next run is cold in its tokenization too (benchmarks flush between runs)."""
    prompt = "Here are some facts about animals. " * 70  # long enough for the tokenization cache
    params = {"temperature": 0, "max_new_tokens": 1}
    first = engine.generate(prompt, params)["output_ids"]
    assert engine.builder.token_cache._entries
    assert engine.flush_cache()
    assert not engine.builder.token_cache._entries
    assert engine.generate(prompt, params)["output_ids"] == first


def test_shared_prefix_is_prefilled_once_in_one_step(engine, tokenizer, reference_of):
    engine.flush_cache()
    prefix = "Here are some facts about animals. " * 20
    qs = [prefix + f"Question {i}: what is animal number {i}?" for i in range(6)]
    passes = engine.get_server_info()["forward_passes"]
    out = engine.generate(qs, {"temperature": 0, "max_new_tokens": 3})
    shared = len(tokenizer(prefix).input_ids) - 2
    # one request prefills the prefix; the others read its K/V as the same step writes them: one
    # extend pass for the six prompts, then two decodes
    assert sum(o["meta_info"]["cached_tokens"] >= shared for o in out) >= 5
    assert engine.get_server_info()["forward_passes"] - passes == 3
    assert [o["output_ids"] for o in out] == reference_of(qs, 3)
    assert_idle(engine)


def test_prompts_sharing_a_chunked_prompt_read_its_published_chunks(smollm_folder, tokenizer, reference_of):
    # the first prompt takes two steps of 96 tokens, each chunk cached as it is scheduled; the others
    # join its last step and read both chunks (the second of which that step writes)
    head = "Facts about rivers and the towns along their banks. " * 14
    qs = [head + "Which river is longest?", head + "Which river is widest?", head[:200] + "Short question?"]
    with Engine(model=str(smollm_folder), quantization="none", max_total_tokens=4096, chunked_prefill_size=96,
                log_level="warning") as e:
        passes = e.get_server_info()["forward_passes"]
        out = e.generate(qs, {"temperature": 0, "max_new_tokens": 4})
        assert [o["output_ids"] for o in out] == reference_of(qs, 4)
        ids = [len(tokenizer(q).input_ids) for q in qs]
        assert 96 < ids[0] <= 192 and out[1]["meta_info"]["cached_tokens"] >= ids[1] - 8
        assert out[2]["meta_info"]["cached_tokens"] >= len(tokenizer(head[:200]).input_ids) - 2
        assert e.get_server_info()["forward_passes"] - passes == 2 + 3  # two extends, three decodes
        assert_idle(e)


def test_a_batch_with_one_prompt_too_long_is_refused_whole(engine, prompts, reference):
    """Every prompt is tokenized and checked before any request goes out: nothing runs or is held,
    and the next batch gets the reference answers."""
    too_long = "hello " * (engine.runner.context_len + 10)
    with pytest.raises(ValueError, match="context length"):
        engine.generate([prompts[0], too_long], {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True})
    assert engine.get_server_info()["num_running"] == 0
    assert_idle(engine)
    assert [o["output_ids"] for o in engine.generate(prompts, GREEDY)] == reference


# ------------------------------------------------------------------ min_new_tokens, stop_regex, logit_bias
CAT = [{"role": "user", "content": "hi"}]


def test_min_new_tokens_outlasts_eos_and_stop_strings(engine):
    prompt = engine.apply_chat_template(CAT)
    free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64})
    n = free["meta_info"]["completion_tokens"]
    assert free["meta_info"]["finish_reason"]["type"] == "stop" and n < 40, "the greedy reply ends on EOS"
    held = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64, "min_new_tokens": n + 5})
    assert held["meta_info"]["completion_tokens"] >= n + 5
    assert held["output_ids"][:n - 1] == free["output_ids"][:n - 1], "same greedy path until the EOS"
    assert not set(held["output_ids"][:n + 4]) & engine.scheduler.eos_ids
    first_word = free["text"].split()[0]
    stopped = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 64, "stop": first_word,
                                       "min_new_tokens": n + 5})
    assert stopped["meta_info"]["completion_tokens"] >= n + 5


def test_stop_regex_ends_at_the_first_matching_token_and_keeps_the_match(engine, tokenizer):
    prompt = engine.apply_chat_template([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    ref = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True})
    pattern = r"[67]\. [67]"  # SmolLM2 answers "1. 1\n2. 2\n..."
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True,
                                   "stop_regex": [pattern]})
    ids = out["output_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert ids == ref["output_ids"][:len(ids)] and len(ids) < 48
    import re

    assert re.search(pattern, tokenizer.decode(ids)) and not re.search(pattern, tokenizer.decode(ids[:-1]))
    assert out["text"] == tokenizer.decode(ids, skip_special_tokens=True), "the match stays in the text"


def test_logit_bias_forbids_and_forces_tokens(engine):
    prompt = engine.apply_chat_template(CAT)
    base = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    free = engine.generate(prompt, base)["output_ids"]
    banned = engine.generate(prompt, {**base, "logit_bias": {str(free[0]): -100}})["output_ids"]
    assert banned[0] != free[0] and free[0] not in banned
    forced = engine.generate(prompt, {**base, "logit_bias": {"1000": 100}})["output_ids"]
    assert forced == [1000] * 6
    with pytest.raises(ValueError, match="logit_bias"):
        engine.generate(prompt, {**base, "logit_bias": {str(10**6): 1}})
