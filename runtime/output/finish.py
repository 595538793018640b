"""Finish checks after each sampled token: EOS and stop ids, stop strings, stop regexes (bounded,
parked on the pattern pool when slow), the length and the context."""

from __future__ import annotations

import functools
import re
from concurrent.futures import Future

from radixlm.constrained.patterns import run_bounded, search
from radixlm.runtime.request.healing import output_tail
from radixlm.runtime.request.req import FinishReason, ParkedCheck, Req

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
        req.parked = ParkedCheck(found, functools.partial(_finish_after_park, req, context_len), source="stop_regex")
        return None
    return _stop_regex_match(found)


def _first_match(tails: list[tuple[str, str]]) -> str | None:
    return next((pattern for pattern, tail in tails if search(pattern, tail) is not None), None)


def _stop_regex_match(pattern: str | None) -> FinishReason | None:
    # SGLang reports the pattern and keeps the matched text in the output
    return None if pattern is None else FinishReason("stop", matched=pattern)


def _finish_after_park(req: Req, context_len: int, pattern: str | None) -> FinishReason | None:
    """The verdict of a parked stop_regex check, then the length checks check_finish left to it."""
    return _stop_regex_match(pattern) or _length_finish(req, context_len)


@functools.lru_cache(maxsize=1024)
def _stop_regex_window(pattern: str) -> int:
    """How many trailing tokens can hold a match: its longest match in characters (each token
    decodes to at least one), plus slack for multi-byte pieces."""
    try:
        longest = re._parser.parse(pattern).getwidth()[1]  # an upper bound; MAXREPEAT when unbounded
    except Exception:  # syntax only the regex module knows: assume unbounded
        longest = STOP_REGEX_WINDOW
    return min(longest, STOP_REGEX_WINDOW) + STOP_WINDOW_SLACK
