"""radixlm.lang against the real in-process Engine on the built-in model (SmolLM2-135M), greedy:
what a gen's options put in its meta info (logprobs, their text, min_tokens), async streaming, and
flush_cache / get_server_info."""

from __future__ import annotations

import math

import pytest

import radixlm.lang as rl

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}


def test_gen_return_logprob_reaches_meta_info(engine):
    @rl.function
    def prog(s):
        s += "1, 2, 3," + rl.gen("n", max_tokens=3, return_logprob=True, top_logprobs_num=2)

    meta = prog.run(backend=engine, **GREEDY).get_meta_info("n")
    lps = meta["output_token_logprobs"]
    assert len(lps) == meta["completion_tokens"] and all(lp <= 0 and not math.isnan(lp) for lp, _, _ in lps)
    # greedy: the sampled token is the top alternative
    assert all(top[0][1] == tid for top, (_, tid, _) in zip(meta["output_top_logprobs"], lps, strict=True))


def test_min_tokens_is_honoured(engine):
    @rl.function
    def yes_no(s, min_tokens):
        s += rl.user("Answer with one word: is the sky blue?")
        s += rl.assistant(rl.gen("a", 24, min_tokens))

    short = yes_no.run(min_tokens=None, backend=engine, **GREEDY)
    longer = yes_no.run(min_tokens=12, backend=engine, **GREEDY)
    assert short.get_meta_info("a")["completion_tokens"] < 12  # the model would stop sooner
    assert longer.get_meta_info("a")["completion_tokens"] >= 12 and longer["a"].startswith(short["a"])


def test_text_in_logprobs_is_the_tokenizers_decode(engine):
    @rl.function
    def prog(s):
        s += "The capital of France is" + rl.gen("x", max_tokens=5, return_logprob=True, top_logprobs_num=2,
                                                return_text_in_logprobs=True, logprob_start_len=0)

    meta = prog.run(backend=engine, **GREEDY).get_meta_info("x")
    entries = meta["output_token_logprobs"] + meta["input_token_logprobs"][1:]
    entries += [e for row in meta["output_top_logprobs"] for e in row]
    assert len(entries) > 10 and all(e[2] == engine.tokenizer.decode([e[1]]) for e in entries)
    plain = rl.function(lambda s: s.__iadd__("Hi" + rl.gen("x", max_tokens=2, return_logprob=True)))
    assert all(e[2] is None for e in plain.run(backend=engine).get_meta_info("x")["output_token_logprobs"])


def test_async_stream_concatenates_to_the_variable(engine):
    import asyncio

    @rl.function
    def prog(s):
        s += "Write a haiku about the sea:\n" + rl.gen("poem", max_tokens=24)

    async def collect():
        state = prog.run(backend=engine, stream=True, **GREEDY)
        return state, [piece async for piece in state.text_async_iter("poem")]

    state, pieces = asyncio.run(collect())
    assert len(pieces) > 1 and "".join(pieces) == state["poem"]


def test_flush_cache_and_server_info(engine):
    @rl.function
    def prog(s):
        s += "A fairly long sentence that the cache should remember between two runs of it." + rl.gen(
            "x", max_tokens=1)

    prog.run(backend=engine, **GREEDY)
    assert prog.run(backend=engine, **GREEDY).get_meta_info("x")["cached_tokens"] > 0
    assert rl.flush_cache(engine) is True
    assert rl.get_server_info(engine)["cache"]["evictable_size"] == 0
    assert prog.run(backend=engine, **GREEDY).get_meta_info("x")["cached_tokens"] == 0
