"""Every sampling parameter through the Engine, each with an assertion that could fail."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.apply_chat_template([{"role": "user", "content": "Tell me a short story about a cat."}])


def test_top_k_1_equals_greedy(engine, prompt):
    greedy = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 16})
    topk1 = engine.generate(prompt, {"temperature": 1.3, "top_k": 1, "max_new_tokens": 16})
    assert topk1["output_ids"] == greedy["output_ids"]


def test_seed_reproducible_across_batches(engine, prompt):
    p = {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 1234}
    alone = engine.generate(prompt, p)
    other = engine.apply_chat_template([{"role": "user", "content": "What is an apple?"}])
    in_batch = engine.generate([other, prompt, other], [{"temperature": 1.0, "max_new_tokens": 16}, p,
                                                        {"temperature": 0.7, "max_new_tokens": 8}])[1]
    assert alone["output_ids"] == in_batch["output_ids"]
    different = [engine.generate(prompt, {**p, "sampling_seed": s})["output_ids"] for s in (1, 2, 3)]
    assert len({tuple(x) for x in different + [alone["output_ids"]]}) > 1


def test_stop_string_trimmed_with_matched_reason(engine, prompt):
    full = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40})["text"]
    words = full.split()
    stop = " " + words[3]  # a string the greedy output is known to contain
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "stop": [stop, "zzzz"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]
    kept = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "stop": stop, "no_stop_trim": True})
    assert kept["text"].endswith(stop)


def test_stop_token_ids_and_ignore_eos(engine, prompt):
    greedy = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 20})
    tok = greedy["output_ids"][4]
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [tok]})
    assert out["output_ids"] == greedy["output_ids"][: greedy["output_ids"].index(tok) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}
    short = engine.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    ended = engine.generate(short, {"temperature": 0, "max_new_tokens": 64})
    assert ended["meta_info"]["finish_reason"]["type"] == "stop"
    forced = engine.generate(short, {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True})
    assert forced["meta_info"]["completion_tokens"] == 64
    assert forced["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.8), ("frequency_penalty", 2.0),
                                         ("presence_penalty", 2.0)])
def test_penalties_change_output(engine, field, value):
    p = engine.apply_chat_template([{"role": "user", "content": "Write a haiku about rain."}])
    base = engine.generate(p, {"temperature": 0, "max_new_tokens": 32})
    pen = engine.generate(p, {"temperature": 0, "max_new_tokens": 32, field: value})
    assert pen["output_ids"] != base["output_ids"]
    # a penalty lowers repetition: fewer repeated tokens in the penalized output
    rep = lambda ids: len(ids) - len(set(ids))  # noqa: E731
    assert rep(pen["output_ids"]) < rep(base["output_ids"])


def test_top_p_and_min_p_restrict_to_likely_tokens(engine, prompt):
    # with a tiny nucleus / a min_p near 1 sampling is greedy-like regardless of the seed
    greedy = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 12})["output_ids"]
    for extra in ({"top_p": 1e-6}, {"min_p": 0.999}):
        out = engine.generate(prompt, {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 7, **extra})
        assert out["output_ids"] == greedy, extra


def test_n_samples_share_prompt(engine, prompt):
    engine.flush_cache()
    outs = engine.generate(prompt, {"temperature": 1.0, "max_new_tokens": 8, "n": 4, "sampling_seed": 3})
    assert isinstance(outs, list) and len(outs) == 4
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    # one sample prefills the prompt; the others reuse it
    assert sum(o["meta_info"]["cached_tokens"] > 0 for o in outs) >= 3


def test_logprobs_match_transformers(engine, hf_smollm, tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    asked = [tokenizer(w, add_special_tokens=False).input_ids[0] for w in (" The", " cat", "!")]
    out = engine.generate(text, {"temperature": 0, "max_new_tokens": 4}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=3, token_ids_logprob=asked)
    meta = out["meta_info"]
    ids = tokenizer(text).input_ids
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm(torch.tensor([full])).logits[0].float(), -1)
    inp = meta["input_token_logprobs"]
    assert inp[0][0] is None and [t for _, t, _ in inp] == ids
    for i in range(1, len(ids)):
        assert inp[i][0] == pytest.approx(ref[i - 1, ids[i]].item(), abs=2e-3)
    for k, (lp, tid, _) in enumerate(meta["output_token_logprobs"]):
        assert lp == pytest.approx(ref[len(ids) - 1 + k, tid].item(), abs=2e-3)
        top = meta["output_top_logprobs"][k]
        assert len(top) == 3 and top[0][1] == tid  # greedy picks the top token
        assert [x[0] for x in top] == sorted([x[0] for x in top], reverse=True)
    # SGLang's token_ids_logprob: the asked ids' logprobs at every position, in the order asked
    rows = [(len(ids) - 1 + k, meta["output_token_ids_logprobs"][k]) for k in range(4)]
    rows += [(i - 1, meta["input_token_ids_logprobs"][i]) for i in range(1, len(ids))]
    assert meta["input_token_ids_logprobs"][0] is None and len(meta["input_token_ids_logprobs"]) == len(ids)
    for position, row in rows:
        assert [t for _, t, _ in row] == asked
        assert [lp for lp, _, _ in row] == pytest.approx([ref[position, t].item() for t in asked], abs=2e-3)
    scored = engine.generate(text, {"max_new_tokens": 0}, return_logprob=True, token_ids_logprob=asked)
    assert [lp for lp, _, _ in scored["meta_info"]["output_token_ids_logprobs"][0]] == pytest.approx(
        [ref[len(ids) - 1, t].item() for t in asked], abs=2e-3)  # a prompt alone: its next position


def test_prefill_only_caches_and_scores(engine, tokenizer):
    engine.flush_cache()
    text = "A long shared context about the history of computing. " * 8
    out = engine.generate(text, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=5)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
    n = len(tokenizer(text).input_ids)
    assert len(out["meta_info"]["input_token_logprobs"]) == n - 5
    again = engine.generate(text + " More.", {"temperature": 0, "max_new_tokens": 2})
    assert again["meta_info"]["cached_tokens"] >= n - 1


def test_input_logprobs_with_cached_prefix_equal_uncached(engine):
    engine.flush_cache()
    prefix = "Question: which animal says meow? Answer:"
    cold = engine.generate(prefix + " cat", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=8)
    engine.generate(prefix, {"max_new_tokens": 0})
    warm = engine.generate(prefix + " cat", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=8)
    assert warm["meta_info"]["cached_tokens"] > 0
    a = [x[0] for x in cold["meta_info"]["input_token_logprobs"]]
    b = [x[0] for x in warm["meta_info"]["input_token_logprobs"]]
    assert a == pytest.approx(b, abs=1e-4)


def test_streamed_chunks_carry_the_text_so_far_as_sglangs_do(engine, prompt, monkeypatch):
    params = {"temperature": 0, "max_new_tokens": 24, "stop": "zzz"}  # a stop string holds text back
    full = engine.generate(prompt, params)
    chunks = list(engine.generate(prompt, params, stream=True))
    assert len(chunks) > 3
    # each chunk extends the one before: SGLang's helpers (stream_and_merge) trim a chunk by the text before it
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"]) and len(after["output_ids"]) >= len(before["output_ids"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert (chunks[-1]["text"], chunks[-1]["output_ids"]) == (full["text"], full["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    monkeypatch.setattr(engine.server_args, "incremental_streaming_output", True)  # SGLang's flag: new text only
    pieces = list(engine.generate(prompt, params, stream=True))
    assert len(pieces) > 3 and all(p["text"] or p["output_ids"] or p["meta_info"]["finish_reason"] for p in pieces)
    assert "".join(p["text"] for p in pieces) == full["text"]
    assert sum((p["output_ids"] for p in pieces), []) == full["output_ids"]
    assert pieces[-1]["meta_info"]["completion_tokens"] == len(full["output_ids"])


def test_abandoned_stream_aborts_and_frees(engine, prompt):
    it = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}, stream=True)
    next(it)
    it.close()  # the client went away
    import time

    for _ in range(100):
        info = engine.get_server_info()
        if info["num_running"] == 0 and info["num_waiting"] == 0:
            break
        time.sleep(0.05)
    assert info["num_running"] == 0 and info["cache"]["protected_size"] == 0


@pytest.mark.parametrize("params,field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"frequency_penalty": 9}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"), ({"stop": [""]}, "stop"), ({"regex": "a", "json_schema": "{}"}, "only one"),
    ({"bogus": 1}, "bogus"), ({"max_new_tokens": "ten"}, "max_new_tokens"),
])
def test_invalid_params_name_the_field(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate("hello", params)


def test_bad_inputs_are_clear_errors(engine):
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[5] * 9000)
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate(input_ids=[10**9])
    with pytest.raises(ValueError, match="empty"):
        engine.generate("")
    with pytest.raises(ValueError, match="exactly one"):
        engine.generate()


def test_async_generate_and_abort_by_id(engine, prompt):
    import asyncio

    async def run():
        a = engine.async_generate(prompt, {"temperature": 0, "max_new_tokens": 8})
        b = engine.async_generate(prompt, {"temperature": 0, "max_new_tokens": 8})
        return await asyncio.gather(a, b)

    a, b = asyncio.run(run())
    assert a["output_ids"] == b["output_ids"] == engine.generate(prompt, {"temperature": 0, "max_new_tokens": 8})[
        "output_ids"]

    import threading

    result = {}
    t = threading.Thread(target=lambda: result.update(engine.generate(
        prompt, {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}, rid="to-abort")))
    t.start()
    import time

    time.sleep(1.0)
    engine.abort("to-abort")
    t.join(60)
    assert not t.is_alive()
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["completion_tokens"] < 500


def test_token_ids_logprob_reports_are_bounded_before_anything_runs(tokenizer):
    from radixlm.runtime.request.builder import MAX_TOKEN_IDS_LOGPROB, RequestBuilder
    from radixlm.runtime.request.errors import RequestError

    builder = RequestBuilder(tokenizer, len(tokenizer), 65536, 65536)  # a long context: 128 ids x 20,000 tokens

    every = list(range(MAX_TOKEN_IDS_LOGPROB))

    def build(return_logprob=True, ids=tuple(every), tokens=20000):
        return builder.build("hi", None, {"max_new_tokens": tokens}, return_logprob, 0, 0, False, None,
                             token_ids_logprob=list(ids))

    with pytest.raises(RequestError, match="logprobs in all"):
        build()
    assert build(tokens=8000).reqs[0].token_ids_logprob == every
    assert build(return_logprob=False).reqs[0].token_ids_asked is None  # reported only with return_logprob
    with pytest.raises(RequestError, match="the limit is"):
        build(ids=[*every, 0], tokens=4)
