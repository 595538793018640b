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
