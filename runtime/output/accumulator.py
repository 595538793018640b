"""The StepOutput a request reports after a step, and the one accumulator of those outputs."""

from __future__ import annotations

from typing import Any

from radixlm.runtime.output.detokenizer import IncrementalDetokenizer
from radixlm.runtime.request.req import FinishReason, Req, StepOutput


def make_step_output(req: Req) -> StepOutput:
    """New tokens since the last report (and their logprobs); input logprobs and the queue time on
    the first report."""
    start = req.sent_len
    first = start == 0
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
            if req.input_token_ids_logprobs:
                out.input_token_ids_logprobs = req.input_token_ids_logprobs
        out.output_logprobs = list(zip(req.output_logprobs[start:], req.output_ids[start:]))
        if req.top_logprobs_num:
            out.output_top_logprobs = req.output_top_logprobs[start:]
        if req.token_ids_logprob:
            out.output_token_ids_logprobs = req.output_token_ids_logprobs[start:]
    req.sent_len = len(req.output_ids)
    return out


class RequestOutput:
    """Everything reported so far for one generation, in SGLang's result shape: the one output
    accumulator of the Engine and the server. Outputs are StepOutputs (the Engine: text is
    detokenized here) or the server's TextOuts (text comes with them from the detokenizer process);
    both carry the same count and logprob fields. `stream` False: only the finished text is read, so
    the Engine decodes it once at the finish instead of step by step."""

    def __init__(self, req: Req, tokenizer=None, stream: bool = True):
        self.req = req
        self.rid = req.rid
        p = req.params
        self.detok = None
        if tokenizer is not None:  # the Engine's (the server's text comes decoded; its HTTP process has no torch)
            from radixlm.runtime.request.healing import healed_text

            self.detok = IncrementalDetokenizer(tokenizer, p.stop, p.skip_special_tokens, p.no_stop_trim,
                                                strip_prefix=healed_text(req.input_ids, p, tokenizer),  # token healing
                                                incremental=stream)
        self.text = ""
        self.output_ids: list[int] = []
        self.input_logprobs: list[list] = []  # [logprob, token id, token text or None]
        self.input_top_logprobs: list[list[list] | None] = []
        self.output_logprobs: list[list] = []
        self.output_top_logprobs: list[list[list]] = []
        self.input_token_ids_logprobs: list[list[list] | None] = []  # token_ids_logprob
        self.output_token_ids_logprobs: list[list[list]] = []
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
        if out.input_token_ids_logprobs:
            self.input_token_ids_logprobs = [None if row is None else _entries(row)
                                             for row in out.input_token_ids_logprobs]
        if out.output_token_ids_logprobs:
            self.output_token_ids_logprobs += [_entries(row) for row in out.output_token_ids_logprobs]
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
            if self.req.token_ids_logprob:  # SGLang's: the asked ids' logprobs, in the order asked
                meta["input_token_ids_logprobs"] = self.input_token_ids_logprobs
                meta["output_token_ids_logprobs"] = self.output_token_ids_logprobs
        return meta

    def to_dict(self) -> dict[str, Any]:
        """The result so far (text and ids cumulative)."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta()}


def _entries(pairs) -> list[list]:
    return [[lp, tid, None] for lp, tid in pairs]
