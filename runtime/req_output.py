"""Finish checks and the StepOutput a request reports after a step."""

from __future__ import annotations

from radixlm.runtime.core import FinishReason, Req, StepOutput
from radixlm.runtime.token_healing import output_tail

STOP_WINDOW_SLACK = 4  # extra tokens decoded beyond the longest stop string, for multi-byte pieces


def check_finish(req: Req, eos_ids: frozenset[int], runner) -> FinishReason | None:
    params = req.params
    last = req.output_ids[-1]
    if not params.ignore_eos and last in eos_ids:
        return FinishReason("stop", matched=last)
    if last in params.stop_token_ids:
        return FinishReason("stop", matched=last)
    if params.stop:
        window = max(len(s) for s in params.stop) + STOP_WINDOW_SLACK
        tail = output_tail(req, runner.tokenizer, window)  # without token healing's prompt text
        for s in params.stop:
            if s in tail:
                return FinishReason("stop", matched=s)
    if len(req.output_ids) >= params.max_new_tokens:
        return FinishReason("length")
    if req.seq_len >= runner.context_len:
        return FinishReason("length", message="reached the context length")
    return None


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
