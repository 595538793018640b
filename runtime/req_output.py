"""Finish checks, the StepOutput a request reports after a step, and the accumulator of those outputs."""

from __future__ import annotations

import functools
import re
from concurrent.futures import Future
from typing import Any

from radixlm.constrained.patterns import run_bounded, search
from radixlm.runtime.core import FinishReason, ParkedCheck, Req, StepOutput
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.token_healing import healed_text, output_tail

STOP_WINDOW_SLACK = 4  # extra tokens decoded beyond the longest stop string, for multi-byte pieces
STOP_REGEX_WINDOW = 256  # tokens searched by a stop_regex whose longest match is unbounded
STOP_REGEX_BUDGET_S = 5.0  # pattern-pool time one request's stop_regex checks may take in all


def check_finish(req: Req, eos_ids: frozenset[int], runner) -> FinishReason | None:
    params = req.params
    last = req.output_ids[-1]
    if len(req.output_ids) >= params.min_new_tokens:  # before that only the length may end it
        if (not params.ignore_eos and last in eos_ids) or last in params.stop_token_ids:
            return FinishReason("stop", matched=last)
        if params.stop or params.stop_regex:
            finish = _check_stop_text(req, runner.tokenizer, runner.context_len)
            if finish is not None or req.parked is not None:  # parked: the length check waits for it
                return finish
    return _length_finish(req, runner.context_len)


def _length_finish(req: Req, context_len: int) -> FinishReason | None:
    if len(req.output_ids) >= req.params.max_new_tokens:
        return FinishReason("length")
    if req.seq_len >= context_len:
        return FinishReason("length", message="reached the context length")
    return None


def _check_stop_text(req: Req, tokenizer, context_len: int) -> FinishReason | None:
    """Stop strings, then stop regexes, searched in the decoded tail of the output."""
    params = req.params
    if params.stop:
        window = max(len(s) for s in params.stop) + STOP_WINDOW_SLACK
        tail = output_tail(req, tokenizer, window)  # without token healing's prompt text
        for s in params.stop:
            if s in tail:
                return FinishReason("stop", matched=s)
    if not params.stop_regex:
        return None
    # the client's patterns run bounded (constrained/patterns.py): inline when they are quick,
    # else on the pattern pool while the request is parked
    if req.pattern_seconds > STOP_REGEX_BUDGET_S:
        return FinishReason("abort", message=f"stop_regex: the patterns took over {STOP_REGEX_BUDGET_S:g}s to search "
                            "in all; simplify them", code=400, field="stop_regex")
    tails = [(pattern, output_tail(req, tokenizer, _stop_regex_window(pattern))) for pattern in params.stop_regex]
    found = run_bounded(lambda: _first_match(tails), inline=req.pattern_seconds == 0)
    if isinstance(found, Future):
        req.parked = ParkedCheck(found, functools.partial(_stop_regex_finish, req, context_len), source="stop_regex")
        return None
    return _stop_regex_finish(req, context_len, found)


def _first_match(tails: list[tuple[str, str]]) -> str | None:
    return next((pattern for pattern, tail in tails if search(pattern, tail) is not None), None)


def _stop_regex_finish(req: Req, context_len: int, pattern: str | None) -> FinishReason | None:
    if pattern is None:  # checked off-thread: what check_finish did not get to yet
        return _length_finish(req, context_len) if req.parked is None else None
    # SGLang reports the pattern and keeps the matched text in the output
    return FinishReason("stop", matched=pattern)


@functools.lru_cache(maxsize=1024)
def _stop_regex_window(pattern: str) -> int:
    """How many trailing tokens can hold a match: its longest match in characters (each token
    decodes to at least one), plus slack for multi-byte pieces."""
    try:
        longest = re._parser.parse(pattern).getwidth()[1]  # an upper bound; MAXREPEAT when unbounded
    except Exception:  # syntax only the regex module knows: assume unbounded
        longest = STOP_REGEX_WINDOW
    return min(longest, STOP_REGEX_WINDOW) + STOP_WINDOW_SLACK


def make_step_output(req: Req) -> StepOutput:
    """New tokens since the last report (and their logprobs); input logprobs and the queue time on
    the first report."""
    start = req.sent_len
    first = start == 0 and not getattr(req, "_reported", False)
    out = StepOutput(
        rid=req.rid,
        new_ids=req.output_ids[start:],
        finish=req.finish,
        prompt_tokens=len(req.input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        jump_forward_tokens=req.jump_forward_tokens,
    )
    if first and req.admitted_at is not None and req.queued_at:
        out.queue_time = max(req.admitted_at - req.queued_at, 0.0)
    if req.return_logprob:
        if first and req.input_logprobs:
            s = req.logprob_start_len
            out.input_logprobs = list(zip(req.input_logprobs, req.input_ids[s:]))
            if req.input_top_logprobs:
                out.input_top_logprobs = req.input_top_logprobs
        out.output_logprobs = list(zip(req.output_logprobs[start:], req.output_ids[start:]))
        if req.top_logprobs_num:
            out.output_top_logprobs = req.output_top_logprobs[start:]
    req.sent_len = len(req.output_ids)
    return out


class RequestOutput:
    """Everything reported so far for one generation, in SGLang's result shape: the one output
    accumulator of the Engine and the server. Outputs are StepOutputs (the Engine: text is
    detokenized here) or the server's TextOuts (text comes with them from the detokenizer process);
    both carry the same count and logprob fields."""

    def __init__(self, req: Req, tokenizer=None):
        self.req = req
        self.rid = req.rid
        p = req.params
        self.detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, p.stop, p.skip_special_tokens, p.no_stop_trim,
            strip_prefix=healed_text(req.input_ids, p, tokenizer))  # token healing (before it backs off)
        self.text = ""
        self.output_ids: list[int] = []
        self.input_logprobs: list[list] = []  # [logprob, token id, token text or None]
        self.input_top_logprobs: list[list[list] | None] = []
        self.output_logprobs: list[list] = []
        self.output_top_logprobs: list[list[list]] = []
        self.last = None  # the latest output (its counts and finish reason are the current ones)
        self.queue_time: float | None = None

    @property
    def finish(self) -> FinishReason | None:
        return self.last.finish if self.last is not None else None

    def add(self, out, text: str | None = None) -> str:
        """Folds one output in; returns the text that became final with it."""
        if text is None:
            text = self.detok.add(out.new_ids, out.finish)
        self.last = out
        self.text += text
        self.output_ids += out.new_ids
        if out.input_logprobs:
            self.input_logprobs = _entries(out.input_logprobs)
        if out.input_top_logprobs:
            self.input_top_logprobs = [None if row is None else _entries(row) for row in out.input_top_logprobs]
        if out.output_logprobs:
            self.output_logprobs += _entries(out.output_logprobs)
        if out.output_top_logprobs:
            self.output_top_logprobs += [_entries(row) for row in out.output_top_logprobs]
        if out.queue_time is not None:
            self.queue_time = out.queue_time
        return text

    def meta(self) -> dict[str, Any]:
        """SGLang's meta_info."""
        step = self.last
        finish = step.finish.to_dict() if step.finish else None
        if finish is not None and finish["type"] == "length":
            finish["length"] = step.completion_tokens  # SGLang's FINISH_LENGTH
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": step.prompt_tokens,
            "completion_tokens": step.completion_tokens,
            "cached_tokens": step.cached_tokens,
            "finish_reason": finish,
            "jump_forward_tokens": step.jump_forward_tokens,
        }
        if self.req.return_logprob:
            meta["input_token_logprobs"] = self.input_logprobs
            meta["output_token_logprobs"] = self.output_logprobs
            if self.req.top_logprobs_num:
                meta["input_top_logprobs"] = self.input_top_logprobs
                meta["output_top_logprobs"] = self.output_top_logprobs
        return meta

    def to_dict(self) -> dict[str, Any]:
        """The result so far (text and ids cumulative)."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta()}


def _entries(pairs) -> list[list]:
    return [[lp, tid, None] for lp, tid in pairs]
