"""Checks on an Engine's answers shared by test modules."""

from __future__ import annotations


def assert_cold_and_warm_equal(engine, prompts: list[str], params: dict, expected: list[list[int]]) -> None:
    """The prompts' output ids equal `expected` with the cache flushed and again from the cache, where
    every prompt except its last token is a hit."""
    engine.flush_cache()
    cold = engine.generate(prompts, params)
    assert [o["output_ids"] for o in cold] == expected
    warm = engine.generate(prompts, params)
    assert [o["output_ids"] for o in warm] == expected
    assert all(o["meta_info"]["cached_tokens"] >= o["meta_info"]["prompt_tokens"] - 1 for o in warm)


def each_alone(engine, prompts: list[str], params: dict) -> list[list[int]]:
    """Each prompt's output ids on its own (one-row decodes), the cache flushed before each."""
    out = []
    for p in prompts:
        engine.flush_cache()
        out.append(engine.generate(p, params)["output_ids"])
    return out


def assert_prefill_is_batch_invariant(engine, prompts: list[str]) -> None:
    """Prompts prefilled alone or all together (one forward of all their tokens, the cache cold): the
    same logprobs to the last bit for every prompt token and the first new one."""
    params = {"temperature": 0, "max_new_tokens": 1}
    alone = []
    for p in prompts:
        engine.flush_cache()
        alone.append(engine.generate(p, params, return_logprob=True, logprob_start_len=0))
    engine.flush_cache()
    together = engine.generate(prompts, params, return_logprob=True, logprob_start_len=0)
    for a, b in zip(alone, together):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert a["meta_info"][key] == b["meta_info"][key]


# engine options under which answers must not change: chunks of 7 tokens, a pool too small for the
# batch (retraction), no cache
INVARIANT_OPTIONS = [{"chunked_prefill_size": 7}, {"max_total_tokens": 160, "chunked_prefill_size": 64},
                     {"disable_radix_cache": True}]
INVARIANT_OPTION_IDS = ["chunked", "retracted", "cache-off"]


def assert_options_keep_answers(engine, options: dict, prompts: list[str], params: dict,
                                expected: list[list[int]]) -> None:
    """`engine`, started with one of INVARIANT_OPTIONS, gives the prompts' `expected` ids (with the small
    pool after retracting some), twice: the second round runs warm, or evicts."""
    if "max_total_tokens" in options:
        out = engine.generate(prompts, params)
        assert engine.get_server_info()["retractions"] > 0, "the pool was meant to be too small for the batch"
        assert [o["output_ids"] for o in out] == expected
    for _ in range(2):
        assert [o["output_ids"] for o in engine.generate(prompts, params)] == expected
