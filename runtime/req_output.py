"""Finish checks and the StepOutput a request reports after a step."""

from __future__ import annotations

import functools
import re

import regex as rx

from radixlm.runtime.core import FinishReason, Req, StepOutput

STOP_WINDOW_SLACK = 4  # extra tokens decoded beyond the longest stop string, for multi-byte pieces
STOP_REGEX_WINDOW = 256  # tokens searched by a stop_regex whose longest match is unbounded
STOP_REGEX_TIMEOUT_S = 0.05  # a pathological pattern fails its own request, never stalls the batch


def check_finish(req: Req, eos_ids: frozenset[int], runner) -> FinishReason | None:
    params = req.params
    last = req.output_ids[-1]
    if len(req.output_ids) >= params.min_new_tokens:  # before that only the length may end it
        if (not params.ignore_eos and last in eos_ids) or last in params.stop_token_ids:
            return FinishReason("stop", matched=last)
        if params.stop or params.stop_regex:
            finish = _check_stop_text(req, runner.tokenizer)
            if finish is not None:
                return finish
    if len(req.output_ids) >= params.max_new_tokens:
        return FinishReason("length")
    if req.seq_len >= runner.context_len:
        return FinishReason("length", message="reached the context length")
    return None


def _check_stop_text(req: Req, tokenizer) -> FinishReason | None:
    """Stop strings, then stop regexes, searched in the decoded tail of the output."""
    params = req.params
    if params.stop:
        window = max(len(s) for s in params.stop) + STOP_WINDOW_SLACK
        tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        for s in params.stop:
            if s in tail:
                return FinishReason("stop", matched=s)
    for pattern in params.stop_regex:
        compiled, window = _stop_regex(pattern)
        tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        try:
            found = compiled.search(tail, timeout=STOP_REGEX_TIMEOUT_S)
        except TimeoutError:
            return FinishReason("abort", message=f"stop_regex {pattern!r} took too long to search; simplify it",
                                code=400, field="stop_regex")
        if found is not None:
            # SGLang reports the pattern and keeps the matched text in the output
            return FinishReason("stop", matched=pattern)
    return None


@functools.lru_cache(maxsize=1024)
def _stop_regex(pattern: str) -> tuple[rx.Pattern, int]:
    """The compiled pattern and how many trailing tokens can hold a match (its longest match in
    characters, as each token decodes to at least one, plus slack for multi-byte pieces)."""
    try:
        longest = re._parser.parse(pattern).getwidth()[1]  # an upper bound; MAXREPEAT when unbounded
    except Exception:  # syntax only the regex module knows: assume unbounded
        longest = STOP_REGEX_WINDOW
    return rx.compile(pattern), min(longest, STOP_REGEX_WINDOW) + STOP_WINDOW_SLACK


def make_step_output(req: Req) -> StepOutput:
    """New tokens since the last report (and their logprobs); input logprobs on the first report."""
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
    if req.return_logprob:
        if first and req.input_logprobs:
            s = req.logprob_start_len
            out.input_logprobs = list(zip(req.input_logprobs, req.input_ids[s:]))
        out.output_logprobs = list(zip(req.output_logprobs[start:], req.output_ids[start:]))
        if req.top_logprobs_num:
            out.output_top_logprobs = req.output_top_logprobs[start:]
    req.sent_len = len(req.output_ids)
    return out
