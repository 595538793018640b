"""One request's failure inside a step stays its own; masks live on the logits' device; jump-forward
on multi-byte text (issue: runtime forward path)."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from radixlm.runtime import Engine
from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.request.req import Req
from radixlm.runtime.scheduler.grammars import GrammarManager

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is", "List three colors:", "def add(a, b):", "Once upon a time",
    "The square root of 16 is", "My favourite fruit is", "Water boils at", "The opposite of hot is",
]
DIGITS = r"[0-9]{2,6}"


def _params(i: int) -> dict:
    p = {"max_new_tokens": 12, "temperature": 0}
    if i % 2:
        p["regex"] = DIGITS
    else:
        p.update(temperature=0.8, sampling_seed=100 + i)
    return p


def test_grammar_failure_mid_decode_fails_only_its_request(engine, monkeypatch):
    solo = [engine.generate(p, _params(i)) for i, p in enumerate(PROMPTS)]
    victim = 3  # a constrained request
    real_accept = type(engine.scheduler.grammars).advance
    calls = {"n": 0}

    def flaky_advance(self, req, token):
        if req.rid == "victim":
            calls["n"] += 1
            if calls["n"] == 2:  # mid-decode, after one accepted token
                raise RuntimeError("grammar matcher blew up")
        return real_accept(self, req, token)

    monkeypatch.setattr(GrammarManager, "advance", flaky_advance)
    rids = [f"r{i}" if i != victim else "victim" for i in range(len(PROMPTS))]
    outs = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], rid=rids)
    assert calls["n"] == 2
    bad = outs[victim]["meta_info"]["finish_reason"]
    assert bad["type"] == "abort" and "grammar matcher blew up" in bad["message"]
    for i, (got, want) in enumerate(zip(outs, solo)):
        if i != victim:
            assert got["output_ids"] == want["output_ids"], i
    _assert_idle(engine)


def test_mask_failure_and_sampling_failure_are_isolated(engine, monkeypatch):
    from radixlm.runtime.sampling import step as step_sampler

    solo = [engine.generate(p, _params(i)) for i, p in enumerate(PROMPTS)]
    real_sample = step_sampler._sample

    def picky_sample(reqs, *args):
        if any(r.rid == "bad-draw" for r in reqs):
            raise FloatingPointError("bad draw")
        return real_sample(reqs, *args)

    monkeypatch.setattr(step_sampler, "_sample", picky_sample)
    rids = [f"s{i}" for i in range(len(PROMPTS))]
    rids[2] = "bad-draw"
    outs = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))], rid=rids)
    assert outs[2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "bad draw" in outs[2]["meta_info"]["finish_reason"]["message"]
    for i, (got, want) in enumerate(zip(outs, solo)):
        if i != 2:
            assert got["output_ids"] == want["output_ids"], i
    _assert_idle(engine)


def _assert_idle(engine):
    info = engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    cache = info["cache"]
    assert cache["protected_size"] == 0
    assert info["free_slots"] + cache["evictable_size"] == info["max_total_tokens"]
    assert info["kv_check"] == "ok", info["kv_check"]


def test_vocab_mask_is_built_on_the_logits_device(engine):
    grammars = engine.scheduler.grammars
    prompt_ids = engine.tokenizer("x").input_ids
    req = Req("mask-test", prompt_ids, SamplingParams.from_dict({"regex": DIGITS}))
    req.grammar = grammars.backend.compile("regex", DIGITS)
    mask = grammars.vocab_mask([req], engine.runner.vocab_size, torch.device("meta"))
    assert mask.device.type == "meta"
    mask = grammars.vocab_mask([req], engine.runner.vocab_size, torch.device("cpu"))
    allowed = mask[0].nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]).isdigit() for t in allowed[:50])


CHINESE = "(北京|上海|广州)是中国的(首都|城市)。"


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
@pytest.mark.parametrize("jump_forward", [True, False])
def test_multibyte_regex_jump_forward(smollm_folder, backend, jump_forward):
    with Engine(model=str(smollm_folder), grammar_backend=backend, disable_jump_forward=not jump_forward,
                max_total_tokens=4096, log_level="warning") as eng:
        prompts = ["中国的首都是哪里？", "Name a city in China:", "上海", "你好"]
        outs = eng.generate(prompts, {"regex": CHINESE, "temperature": 0, "max_new_tokens": 40})
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
            assert re.fullmatch(CHINESE, out["text"]), out["text"]
            assert "\ufffd" not in out["text"]
        if jump_forward:
            assert any(o["meta_info"]["jump_forward_tokens"] > 0 for o in outs)


@pytest.mark.cuda
def test_constrained_sampling_with_cuda_logits(engine):
    """Logits on the GPU, masks filled on the host: the mask is moved and applied there."""
    from radixlm.runtime.sampling.step import sample_requests

    prompt_ids = engine.tokenizer("x").input_ids
    req = Req("cuda-test", prompt_ids, SamplingParams.from_dict({"regex": DIGITS, "temperature": 0}))
    req.grammar = engine.scheduler.grammars.backend.compile("regex", DIGITS)
    logits = torch.randn(1, engine.runner.vocab_size, device="cuda")
    out = sample_requests([req], logits, engine.scheduler.grammars)
    assert engine.tokenizer.decode([out.next_ids[0]]).isdigit()


def test_masks_are_filled_while_the_forward_runs(engine, monkeypatch):
    """A step with grammar rows has their masks filled on the scheduler thread while its forward runs
    (on a GPU that host work then hides behind the device), and the answers are those of masks filled
    after the forward, on the launching thread."""
    from radixlm.runtime.scheduler.overlap import Overlap

    params = [{"max_new_tokens": 12, "temperature": 0, "regex": DIGITS},
              {"max_new_tokens": 24, "temperature": 0.8, "sampling_seed": 7, "json_schema": '{"type": "object", '
               '"properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}'}]
    prompts = PROMPTS[:2]

    def serial_launch(overlap, batch):  # the launch fills the masks itself, after the forward
        return overlap.runner.compute.run(overlap.launch, batch)

    with monkeypatch.context() as m:
        m.setattr(Overlap, "launch_now", serial_launch)
        serial = engine.generate(prompts, params)
    # a step launched after the last one that drew (overlap) may still be running: a call settles it,
    # so every forward counted below is one of the next batch's
    engine.get_server_info()

    sched, runner = engine.scheduler, engine.runner
    fill, done = type(sched.grammars).fill_masks, threading.Condition()
    counts = {"fills": 0, "forwards": 0}

    def signalling_fill(self, *args):
        try:
            return fill(self, *args)
        finally:
            with done:
                counts["fills"] += 1
                done.notify_all()

    forward, waits = runner.forward, []

    def waiting_forward(batch):  # every step of these requests has a grammar row that draws: one fill each
        with done:
            counts["forwards"] += 1
            step = counts["forwards"]
            # this step's masks, filled while it runs; filled after the forward, they would never come
            waits.append(done.wait_for(lambda: counts["fills"] >= step, timeout=10))
        return forward(batch)

    monkeypatch.setattr(type(sched.grammars), "fill_masks", signalling_fill)
    monkeypatch.setattr(runner, "forward", waiting_forward)
    outs = engine.generate(prompts, params)
    assert waits and all(waits), (waits, counts)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in serial]
    assert re.fullmatch(DIGITS, outs[0]["text"]), outs[0]["text"]
    assert set(json.loads(outs[1]["text"])) == {"n"}, outs[1]["text"]
    _assert_idle(engine)


def test_a_failure_filling_the_masks_ends_the_step_without_a_hang(engine, monkeypatch):
    """If filling a step's masks fails as a whole (not one grammar: those fail their own request), the
    launch waiting for them gets the error instead of waiting forever: the step's requests end with an
    error, their KV is given back, and the next request is served."""
    fill = GrammarManager.fill_masks

    def broken_fill(self, reqs, *args):
        if any(r.rid == "doomed" for r in reqs):
            raise MemoryError("no room for the masks")
        return fill(self, reqs, *args)

    monkeypatch.setattr(GrammarManager, "fill_masks", broken_fill)
    out = engine.generate(PROMPTS[0], _params(1), rid="doomed")
    assert out["meta_info"]["finish_reason"]["type"] == "abort", out
    after = engine.generate(PROMPTS[1], _params(1))
    assert after["meta_info"]["finish_reason"]["type"] in ("stop", "length"), after
    assert re.fullmatch(DIGITS, after["text"]), after["text"]
    _assert_idle(engine)
