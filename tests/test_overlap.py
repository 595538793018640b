"""The overlap schedule (issue 20 item 3) never changes an answer: the same batches give the same
ids, texts, finish reasons and logprobs with overlap on and off, each equal to its solo run, and the
pool's accounting is exact afterwards. Steady greedy decode really overlaps (steps are launched
while the previous one runs); what needs the host first (grammars, token healing, stop_regex,
penalties) runs unoverlapped beside it."""

from __future__ import annotations

import contextlib
import json
import re
import time

import pytest

from radixlm.runtime import Engine

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):", "Once upon a time",
           "1, 2, 3, 4,", "The best way to learn is"]


@pytest.fixture(scope="module")
def engines(smollm_folder):
    # fp16: its rows move with the schedule only in their last bits, so logprobs must agree within 1e-4
    # (the built-in model's default, int4, has bfloat16 rows that move by more: README, quantization)
    on = Engine(model=str(smollm_folder), quantization="fp16", max_total_tokens=4096, log_level="warning")
    off = Engine(model=str(smollm_folder), quantization="fp16", max_total_tokens=4096, disable_overlap_schedule=True,
                 log_level="warning")
    yield on, off
    on.shutdown()
    off.shutdown()


def assert_idle(engine: Engine) -> None:
    info = engine.get_server_info()
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["cache"]["protected_size"] == 0, "a finished request still locks cache nodes"
    assert info["free_slots"] + info["cache"]["evictable_size"] == info["max_total_tokens"], "KV slots leaked"
    assert info["kv_check"] == "ok", info["kv_check"]


def same(a: dict, b: dict, logprobs: bool = False) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert a["text"] == b["text"]
    assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
    if logprobs:  # a batch's shape changes float rounding (not ids): logprobs within 1e-4
        for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
            x, y = _entries(a["meta_info"].get(key)), _entries(b["meta_info"].get(key))
            assert [e[1:] for e in x] == [e[1:] for e in y], key
            assert all(p == q or abs(p - q) < 1e-4 for (p, *_), (q, *_) in zip(x, y)), key


def _entries(value) -> list[list]:
    """[logprob, id, text] entries, top-logprob rows flattened."""
    out = []
    for e in value or []:
        if e and isinstance(e[0], list):
            out += _entries(e)
        elif e is not None:
            out.append(list(e))
    return out


def run_both(engines, params: list[dict], prompts=PROMPTS, logprobs: bool = False, **kwargs) -> list[dict]:
    """The batch on both engines and each request solo on the overlapped one; all must agree."""
    on, off = engines
    got_on = on.generate(prompts, params, **kwargs)
    got_off = off.generate(prompts, params, **kwargs)
    for i, (a, b) in enumerate(zip(got_on, got_off)):
        same(a, b, logprobs)
        solo_kwargs = {k: (v[i] if isinstance(v, list) else v) for k, v in kwargs.items()}
        same(a, on.generate(prompts[i], params[i], **solo_kwargs), logprobs)
    assert_idle(on)
    assert_idle(off)
    return got_on


def test_greedy_mixed_batch_with_stops_overlaps_and_agrees(engines):
    on, _ = engines
    before = on.get_server_info()["overlapped_steps"]
    params = [
        {"temperature": 0, "max_new_tokens": 40, "stop": [" and", "."]},
        {"temperature": 0, "max_new_tokens": 3},  # ends on its last allowed token: left out of N+1
        {"temperature": 0, "max_new_tokens": 48, "stop_token_ids": [28, 30]},
        {"temperature": 0, "max_new_tokens": 32, "min_new_tokens": 20},
        {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True},
        {"temperature": 0, "max_new_tokens": 17, "stop": ["\n"]},
    ]
    outs = run_both(engines, params)
    assert {o["meta_info"]["finish_reason"]["type"] for o in outs} >= {"stop", "length"}
    assert on.get_server_info()["overlapped_steps"] > before, "steady decode never overlapped"


def test_rows_leaving_and_joining_keep_their_own_sampling_settings(engines):
    """The decode batch's sampling state is filtered as rows finish and merged as rows join
    (sampling/running.py): a sampled row whose logit_bias pins one token must keep drawing it, and
    its greedy neighbours their solo answers, wherever the rows sit after each change."""
    on, off = engines
    pinned = {"temperature": 1.0, "logit_bias": {"28": 100}, "ignore_eos": True}  # draws token 28 every step
    params = [
        {"temperature": 0, "max_new_tokens": 5},
        {**pinned, "max_new_tokens": 24},
        {"temperature": 0, "max_new_tokens": 9},
        {**pinned, "max_new_tokens": 13, "top_p": 0.9},
        {"temperature": 0, "max_new_tokens": 30},
        {"temperature": 0, "max_new_tokens": 2},
    ]
    before = [e.scheduler.sampling_state.filtered for e in engines]
    outs = run_both(engines, params)
    assert all(e.scheduler.sampling_state.filtered > n for e, n in zip(engines, before))
    for out, p in zip(outs, params):
        if "logit_bias" in p:
            assert out["output_ids"] == [28] * p["max_new_tokens"]


def test_constraints_with_jump_forward_beside_plain_rows(engines):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = [
        {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)},
        {"temperature": 0, "max_new_tokens": 40},
        {"temperature": 0, "max_new_tokens": 24, "regex": r"(yes|no), because [a-z ]{5,20}\."},
        {"temperature": 0, "max_new_tokens": 40, "stop_regex": [r"\d\d"]},
        {"temperature": 0, "max_new_tokens": 30, "frequency_penalty": 0.5},
        {"temperature": 0, "max_new_tokens": 30, "token_healing": True},
    ]
    run_both(engines, params)


def test_seeded_sampling_and_n(engines):
    params = [{"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 32, "sampling_seed": 7 + i, "n": 1 + i % 2}
              for i in range(len(PROMPTS))]
    on, off = engines
    def flat(results):  # a prompt with n > 1 gives a list of its n results
        return [r for res in results for r in (res if isinstance(res, list) else [res])]

    a, b = flat(on.generate(PROMPTS, params)), flat(off.generate(PROMPTS, params))
    assert len(a) == len(b) == sum(p["n"] for p in params)
    for x, y in zip(a, b):
        same(x, y)
    assert_idle(on)


def test_logprobs_and_input_logprobs(engines):
    params = [{"temperature": 0, "max_new_tokens": 20}] * len(PROMPTS)
    run_both(engines, params, logprobs=True, return_logprob=True, top_logprobs_num=3, logprob_start_len=0)


def test_abandoned_stream_mid_decode_frees_everything(engines):
    on, _ = engines
    full = on.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True})
    others = [on.generate(p, {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}, stream=True)
              for p in PROMPTS[1:3]]
    stream = on.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}, stream=True)
    text = [chunk["text"] for _, chunk in zip(range(5), stream)][-1]  # each chunk: the text so far
    stream.close()  # aborts it while its decode steps are in flight
    for other in others:
        for _ in other:
            pass
    assert full["text"].startswith(text)
    assert_idle(on)


@pytest.mark.parametrize("extra", [{"max_total_tokens": 600, "chunked_prefill_size": 64},  # retraction
                                   {"max_total_tokens": 4096, "chunked_prefill_size": 7}])  # chunked prefill
def test_small_pool_and_chunks(make_tiny_model, extra):
    params = [{"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}] * 5
    prompts = [p * 6 for p in PROMPTS[:5]]
    outs = []
    for overlap_off in (False, True):  # a tiny model: the steps' bookkeeping is under test, not the weights
        with Engine(model=str(make_tiny_model()), quantization="fp16", disable_overlap_schedule=overlap_off,
                    log_level="warning", **extra) as engine:
            outs.append(engine.generate(prompts, params))
            info = engine.get_server_info()
            assert_idle(engine)
            if extra["max_total_tokens"] == 600:
                assert info["retractions"] > 0, "the pool was meant to force retraction"
    for a, b in zip(*outs):
        same(a, b)


def test_idle_check_and_double_free_check_catch_leaks(engines):
    """The checks every test above relies on (RADIXLM_DEBUG_KV=1, set by conftest) do fire."""
    on, _ = engines
    kv, allocator = on.scheduler.kv, on.runner.allocator
    assert kv.check_idle() == "ok"
    leaked = allocator.alloc(2)
    assert "2 KV slots neither free nor cached" in kv.check_idle()
    allocator.free(leaked)
    with pytest.raises(RuntimeError, match="double free"):
        allocator.free(leaked[:1])
    assert kv.check_idle() == "ok"


def test_a_finished_request_finds_its_slots_free_at_once(make_tiny_model, monkeypatch):
    """A row that stops at step N (a stop id) was already launched in step N+1. Whatever the client
    asks right after its last token (server_info, flush_cache) is answered with that step's slot
    free: the driver is held after each delivery so the question arrives before the next step."""
    from radixlm.runtime.driver import QueueTransport
    from radixlm.runtime.executor.forward_batch import ForwardMode
    from radixlm.runtime.executor.model_runner import ModelRunner

    deliver = QueueTransport.deliver

    def slow_deliver(self, outputs, stats):
        deliver(self, outputs, stats)
        if any(o.finish is not None for o in outputs):
            time.sleep(0.3)  # the client's next call is queued before the driver steps again

    with Engine(model=str(make_tiny_model()), max_total_tokens=400, log_level="warning") as engine:
        plain = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        ids = engine.generate("one two three", plain)["output_ids"]
        k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
        monkeypatch.setattr(QueueTransport, "deliver", slow_deliver)
        out = engine.generate("one two three", {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ids[k]]})
        assert out["output_ids"] == ids[: k + 1] and out["meta_info"]["finish_reason"]["type"] == "stop"
        assert_idle(engine)
        assert engine.get_server_info()["overlapped_steps"] > 0
        engine.generate("one two three", {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ids[k]]})
        assert engine.flush_cache(), "refused: a step of finished rows was still in flight"

        # the step launched behind the finished row fails: the answer still comes, its slot is freed
        forward, decodes = ModelRunner.forward, []

        def failing_forward(self, batch):
            if batch.mode is ForwardMode.DECODE:
                decodes.append(batch)
                if len(decodes) == k + 1:  # decode k draws ids[k], the stop id: this is the one behind it
                    raise RuntimeError("injected failure of a step nobody waits for")
            return forward(self, batch)

        monkeypatch.setattr(ModelRunner, "forward", failing_forward)
        out = engine.generate("one two three", {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ids[k]]})
        assert out["output_ids"] == ids[: k + 1]
        assert_idle(engine)
        assert len(decodes) == k + 1, "the step behind the finished row never ran"


@pytest.mark.parametrize("overlap", [True, False])
def test_a_forward_that_fails_mid_decode_ends_its_requests_and_frees_their_steps(make_tiny_model, monkeypatch,
                                                                                  overlap):
    """A decode forward raising (with overlap, while the next step is already launched behind it): its
    requests end with an error, the slots of the failed step and of any launched behind it are freed,
    and the engine goes on."""
    from radixlm.runtime.executor.forward_batch import ForwardMode
    from radixlm.runtime.executor.model_runner import ModelRunner

    forward = ModelRunner.forward
    decodes = []

    def failing_forward(self, batch):
        if batch.mode is ForwardMode.DECODE:
            decodes.append(batch)
            if len(decodes) == 6:
                raise RuntimeError("injected forward failure")
        return forward(self, batch)

    monkeypatch.setattr(ModelRunner, "forward", failing_forward)
    with Engine(model=str(make_tiny_model()), max_total_tokens=400, log_level="warning",
                disable_overlap_schedule=not overlap) as engine:
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        outs = engine.generate(["one two three", "four five"], params)
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        assert_idle(engine)
        assert engine.generate("one two three", params)["meta_info"]["completion_tokens"] == 24
        assert_idle(engine)


def test_a_prefill_that_fails_leaves_nothing_of_its_prompts_in_the_cache(make_tiny_model, monkeypatch):
    """Prompts enter the radix cache when their step is scheduled; when that step's forward fails
    (here before it wrote any K/V), a later request must not read their unwritten slots as cached."""
    from radixlm.runtime.executor.forward_batch import ForwardMode
    from radixlm.runtime.executor.model_runner import ModelRunner

    forward, failed = ModelRunner.forward, []

    def failing_forward(self, batch):
        if batch.mode is ForwardMode.EXTEND and not failed:
            failed.append(batch)
            raise RuntimeError("injected prefill failure")
        return forward(self, batch)

    prompts = ["one two three four five six seven eight nine ten " * 4 + tail for tail in ("a", "b")]
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with Engine(model=str(make_tiny_model()), max_total_tokens=800, log_level="warning") as engine:
        want = [o["output_ids"] for o in engine.generate(prompts, params)]
        assert engine.flush_cache()
        monkeypatch.setattr(ModelRunner, "forward", failing_forward)
        outs = engine.generate(prompts, params)
        assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
        assert_idle(engine)
        again = engine.generate(prompts[0], params)
        assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == want[0]
        assert_idle(engine)


# --------------------------------------------------------------------------- constrained rows overlap too
RECORD = {"type": "object", "additionalProperties": False, "required": ["customer_full_name", "account_level"],
          "properties": {"customer_full_name": {"type": "string", "maxLength": 24},
                         "account_level": {"enum": ["basic", "premium", "enterprise"]}}}
CONSTRAINED = [
    {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(RECORD)},  # forced keys: jump-forward
    {"temperature": 0, "max_new_tokens": 40},  # a free row beside them
    {"temperature": 0, "max_new_tokens": 24, "regex": r"(yes|no), because [a-z ]{5,30}\."},
    {"temperature": 0.9, "max_new_tokens": 32, "sampling_seed": 11, "json_schema": json.dumps(RECORD)},
    {"temperature": 0, "max_new_tokens": 30, "regex": r"[A-Z][a-z]+( [a-z]+)*", "stop": [" the"]},
    {"temperature": 0, "max_new_tokens": 30, "json_schema": json.dumps(RECORD), "stop_regex": [r"\d"]},  # parks
    # vLLM's allowed_token_ids (SmolLM2's " yes", " no", " maybe"), with a grammar of its own and without
    {"temperature": 0.9, "max_new_tokens": 16, "sampling_seed": 5, "allowed_token_ids": [9805, 787, 5196]},
    {"temperature": 0, "max_new_tokens": 16, "regex": "( yes| no| maybe){3}", "allowed_token_ids": [9805, 787]},
]


class MaskOrder:
    """Counts, per request, the masks filled for its draws and the draws its grammar accepted. A mask
    for draw k must be filled after draws 1..k-1 were accepted: at every fill the two counts are equal
    (a fill that runs ahead of its step's resolve sees one draw fewer accepted than masks filled)."""

    def __init__(self, monkeypatch):
        from radixlm.runtime.scheduler.grammars import GrammarManager
        from radixlm.runtime.scheduler.scheduler import Scheduler

        self.filled: dict[str, int] = {}
        self.advanced: dict[str, int] = {}
        self.early: list[str] = []
        fill, advance = GrammarManager.fill_masks, Scheduler._advance

        def counting_fill(grammars, reqs, vocab_size, device, wanted=None):
            for i, req in enumerate(reqs):
                if req.grammar is not None and req.finish is None and (wanted is None or wanted[i]):
                    if self.filled.get(req.rid, 0) != self.advanced.get(req.rid, 0):
                        self.early.append(req.rid)
                    self.filled[req.rid] = self.filled.get(req.rid, 0) + 1
            return fill(grammars, reqs, vocab_size, device, wanted)

        def counting_advance(scheduler, req, token, out, i):
            if req.grammar is not None:
                self.advanced[req.rid] = self.advanced.get(req.rid, 0) + 1
            return advance(scheduler, req, token, out, i)

        monkeypatch.setattr(GrammarManager, "fill_masks", counting_fill)
        monkeypatch.setattr(Scheduler, "_advance", counting_advance)


def test_constrained_rows_overlap_and_agree_with_overlap_off(engines, monkeypatch):
    """JSON, regex, seeded and stop-string rows beside a free one: the same ids, texts and finish
    reasons with overlap on and off and alone, while constrained steps really overlap; every mask is
    filled only after the draws before it went through the grammar."""
    from radixlm.runtime.executor.forward_batch import ForwardMode
    from radixlm.runtime.scheduler.overlap import Overlap

    on, _ = engines
    order = MaskOrder(monkeypatch)
    after_extend = []
    next_decode = Overlap.next_decode

    def counting(overlap, prev, future, running):
        following = next_decode(overlap, prev, future, running)
        if following is not None and prev.mode is ForwardMode.EXTEND:
            after_extend.append(len(prev.scheduled))
        return following

    monkeypatch.setattr(Overlap, "next_decode", counting)
    before = on.get_server_info()["overlapped_steps"]
    prompts = [f"Customer record {i}: " + p for i, p in enumerate(PROMPTS + PROMPTS[:2])]
    outs = run_both(engines, CONSTRAINED, prompts=prompts)
    assert set(outs[6]["output_ids"]) <= {9805, 787, 5196} and len(outs[6]["output_ids"]) == 16
    assert re.fullmatch("( yes| no){3}", outs[7]["text"]) and outs[7]["meta_info"]["finish_reason"]["type"] == "stop"
    assert on.get_server_info()["overlapped_steps"] - before >= 20, "constrained steps did not overlap"
    assert after_extend, "no step followed a jump-forward re-extend while it ran"
    assert order.early == [] and sum(order.filled.values()) > 50
    for out in (outs[0], outs[3]):
        assert set(json.loads(out["text"])) == set(RECORD["properties"]), out["text"]
    assert sum(o["meta_info"].get("jump_forward_tokens", 0) for o in outs) > 0, "no jump-forward happened"


def test_a_mask_filled_before_its_step_is_resolved_is_caught(engines, monkeypatch):
    """The check above fails on a deliberately early fill: step N+1's masks filled before step N's
    tokens went through the grammars."""
    from radixlm.runtime.scheduler.overlap import Overlap
    from radixlm.runtime.scheduler.scheduler import Scheduler

    on, _ = engines
    order = MaskOrder(monkeypatch)

    def early(self):
        batch, future = self._inflight
        outputs = self._poll_grammars()
        following = self.overlap.next_decode(batch, future, self.running)
        self._inflight = None if following is None else (following, self.overlap.submit(following))
        if following is not None and following.masks is not None:
            following.masks.run_here()  # too early: step N's draws are not in the grammars yet
        return outputs + self.resolve(batch, future.result())

    def every_row(overlap, batch):  # masks of every grammar row, whatever its state
        runner = overlap.runner
        return overlap.grammars.fill_masks([sr.req for sr in batch.sampling], runner.vocab_size, runner.device)

    monkeypatch.setattr(Scheduler, "_step_inflight", early)
    monkeypatch.setattr(Overlap, "_follow_masks", every_row)
    with contextlib.suppress(ValueError):  # a draw masked for the wrong state may be refused: a 400
        on.generate(["Customer record: "] * 2, [{"temperature": 0, "max_new_tokens": 24, "regex": "[a-z ]{10,40}"}] * 2)
    assert order.early, "an early fill went unnoticed"
    assert_idle(on)


def test_a_grammar_failure_in_an_overlapped_step_fails_its_request_alone(engines, monkeypatch):
    from radixlm.runtime.scheduler.grammars import GrammarManager

    on, _ = engines
    prompts = [f"Customer record {i}: " for i in range(4)]
    params = [{"temperature": 0, "max_new_tokens": 24, "regex": "[a-z ]{10,40}"}] * 4
    solo = [on.generate(p, q) for p, q in zip(prompts, params)]
    fill, fills = GrammarManager.fill_masks, {"n": 0}

    def failing_fill(grammars, reqs, vocab_size, device, wanted=None):
        victim = next((r for r in reqs if r.rid == "victim" and r.grammar is not None), None)
        if victim is not None:
            fills["n"] += 1
            if fills["n"] == 6:  # mid-decode, in an overlapped step
                real = victim.grammar.fill_mask

                def broken(bitmask, row):
                    victim.grammar.fill_mask = real
                    raise RuntimeError("matcher state lost")
                victim.grammar.fill_mask = broken
        return fill(grammars, reqs, vocab_size, device, wanted)

    monkeypatch.setattr(GrammarManager, "fill_masks", failing_fill)
    outs = on.generate(prompts, params, rid=["a", "victim", "c", "d"])
    assert fills["n"] >= 6
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "matcher state lost" in outs[1]["meta_info"]["finish_reason"]["message"]
    assert [o["output_ids"] for i, o in enumerate(outs) if i != 1] == [s["output_ids"] for i, s in enumerate(solo)
                                                                        if i != 1]
    assert_idle(on)


def test_a_row_whose_check_ends_between_its_mask_and_its_resolve_draws_again(engines, monkeypatch):
    """A row parked on a pool check when step N+1's masks are filled gets no mask; if the check ends
    before N+1 is resolved, its N+1 draw (unmasked) must still be dropped and drawn again."""
    from radixlm.runtime.scheduler.overlap import Overlap

    on, _ = engines
    prompts = [f"Customer record {i}: " for i in range(3)]
    # digits where the model would write words: a draw without its mask is refused by the grammar
    params = [{"temperature": 0, "max_new_tokens": 24, "regex": "[0-9]{12,30}"}] * 3
    solo = [on.generate(p, q)["output_ids"] for p, q in zip(prompts, params)]
    follow, calls = Overlap._follow_masks, {"n": 0}

    def parked_while_filled(overlap, batch):
        calls["n"] += 1
        if calls["n"] % 3:
            return follow(overlap, batch)
        victim, parked = batch.sampling[0].req, overlap.parked
        with monkeypatch.context() as m:  # its check still running on the pool, for this fill only
            m.setattr(overlap, "parked", lambda req: req is victim or parked(req))
            return follow(overlap, batch)

    monkeypatch.setattr(Overlap, "_follow_masks", parked_while_filled)
    order = MaskOrder(monkeypatch)
    outs = on.generate(prompts, params)
    assert calls["n"] >= 6, "constrained steps did not overlap"
    assert order.early == [], "a draw went through its grammar without a mask of its own"
    assert [o["output_ids"] for o in outs] == solo
    assert_idle(on)
