"""What one step runs: the scheduled rows of a batch, and the launched step's results on the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixlm.runtime.executor.compute_thread import Task
from radixlm.runtime.executor.forward_batch import ForwardBatch, ForwardMode
from radixlm.runtime.request.req import Req
from radixlm.runtime.sampling.kernels import SamplingBatch, compute_logprobs, rows_token_logprobs, top_logprobs
from radixlm.runtime.sampling.step import DeviceSampled


@dataclass(slots=True)
class ScheduledReq:
    req: Req
    start: int  # first new position
    end: int  # one past the last new position
    logit_rows: list[int]  # rows of the logits tensor that belong to this request
    logit_pos0: int  # position of the first of those rows

    @property
    def samples(self) -> bool:
        """Whether this row draws a token: not a chunk of a longer prompt, not a prefill-only prompt."""
        req = self.req
        if self.end < req.seq_len:
            return False
        return bool(req.output_ids) or (req.params.max_new_tokens > 0 and not req.finished)

    def collect_input_logprobs(self, logits: torch.Tensor) -> None:
        """Adds the logprobs of this row's prompt tokens (from the request's logprob_start_len) that the
        step's `logits` predicted to the request's input logprobs (and top-k, if asked)."""
        req = self.req
        n_in = len(req.input_ids)
        if not req.input_logprobs and self.start <= req.logprob_start_len:
            req.input_logprobs = [None] if req.logprob_start_len == 0 else []
            req.input_top_logprobs = [None] if req.logprob_start_len == 0 else []
            req.input_token_ids_logprobs = [None] if req.logprob_start_len == 0 else []
        rows, targets = [], []
        for k, row in enumerate(self.logit_rows):
            p = self.logit_pos0 + k
            if req.logprob_start_len <= p + 1 < n_in:
                rows.append(row)
                targets.append(req.input_ids[p + 1])
        if rows:
            lp = compute_logprobs(logits[rows], torch.tensor(targets, device=logits.device))
            req.input_logprobs += lp.tolist()
            if req.top_logprobs_num:  # SGLang's input_top_logprobs, aligned with input_logprobs
                req.input_top_logprobs += top_logprobs(logits[rows], req.top_logprobs_num)
            if req.token_ids_logprob:  # SGLang's input_token_ids_logprobs, aligned the same way
                req.input_token_ids_logprobs += rows_token_logprobs(logits[rows], req.token_ids_logprob)


@dataclass(slots=True)
class Batch:
    """schedule()'s answer: the rows and their ForwardBatch, already on the model's device."""

    mode: ForwardMode
    scheduled: list[ScheduledReq]
    forward: ForwardBatch
    # an overlapped decode step (overlap.py): its new slots (host), the step whose draws are its
    # inputs, which of that step's rows it continues, and its sampling settings fixed in advance
    out_slots: torch.Tensor | None = None
    follows: Task | None = None
    follow_rows: torch.Tensor | None = None  # None: all of them, in order
    sampling_batch: SamplingBatch | None = None
    # the sampling rows' grammar masks (GrammarManager.fill_masks), filled on the scheduler thread
    # while the forward runs (Overlap.launch_now); None: the launch fills them itself
    masks: Task | None = None
    # rows (ids of their ScheduledReq) whose mask was left all-allowed because they were finished,
    # parked or moved on when it was filled: resolve drops their draws even if they have resumed since
    unmasked: set[int] = field(default_factory=set)
    # the rows that draw a token, decided here (on the scheduler thread), in the draws' order
    sampling: list[ScheduledReq] = field(init=False)

    def __post_init__(self) -> None:
        # a decode row's one new token is its pending one, and a row that finished is not scheduled:
        # every decode row draws
        decode = self.mode is ForwardMode.DECODE
        self.sampling = list(self.scheduled) if decode else [sr for sr in self.scheduled if sr.samples]


@dataclass(slots=True)
class Launched:
    """launch()'s answer: what resolve() needs, still on the device."""

    logits: torch.Tensor  # [rows, V]: input logprobs read it
    sampled: DeviceSampled | None  # one row per Batch.sampling
