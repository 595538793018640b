"""Prefill admission: which waiting, chunked and jump-forward requests extend this step.

One budget of new tokens per step (``chunked_prefill_size``). Candidates in order: running requests
whose jump-forward appended tokens (they re-extend), the chunked request (the rest of a prompt too
long for one step), then the waiting queue, sorted longest cached prefix first (``lpm``; the
match is the radix tree's, peeked without splitting). A new request is admitted only if the pool
holds its prompt plus a learned share of what the running requests will still need. A prompt's new
tokens enter the radix cache as they are scheduled (KVManager.publish), so a request behind it in
the same step that shares them reads them as cached: a burst sharing a system prompt computes it
once, in one step. A prompt past the budget is chunked (each chunk published as it is scheduled).
When only jump-forward extends are picked, the rest of the running batch decodes in the same pass
(a decode row is a one-token extend).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardBatch, ForwardMode
from radixlm.runtime.request.req import Req
from radixlm.runtime.scheduler.batch import Batch, ScheduledReq
from radixlm.runtime.scheduler.kv import KVManager

LPM_MAX_QUEUE = 128


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    policy: str  # lpm | fcfs
    chunk_size: int  # new tokens per step (chunked_prefill_size)
    max_running: int  # requests holding KV at once (max_running_requests)


@dataclass(slots=True)
class RunningView:
    """What admission reads of the running batch for one step."""

    running: list[Req]
    parked: Callable[[Req], bool]  # a row waiting for its pattern check does not extend
    new_token_ratio: float  # the learned share of max_new_tokens running requests still need


class PrefillAdmission:
    """Picks and allocates a step's extend rows. Owns the waiting queue (and its order) and the
    request whose prompt is being prefilled in chunks."""

    def __init__(self, kv: KVManager, make_batch: Callable[[BatchPlan], ForwardBatch],
                 limits: AdmissionLimits) -> None:
        self.kv = kv
        self.make_batch = make_batch
        self.limits = limits
        self.waiting: list[Req] = []
        self.chunked: Req | None = None

    def schedule(self, view: RunningView) -> Batch | None:
        if not self.waiting and self.chunked is None and not any(r.seq_len - r.kv_len > 1 for r in view.running):
            return None
        self._order_waiting()
        picked = self._pick(view)
        return self._build(picked) if picked else None

    def _order_waiting(self) -> None:
        if self.limits.policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            prefix = {id(r): self.kv.peek_prefix_len(r) for r in self.waiting}
            self.waiting.sort(key=lambda r: -prefix[id(r)])  # stable: fcfs among equals

    def _pick(self, view: RunningView) -> list[tuple[Req, int, int]]:
        kv = self.kv
        budget = self.limits.chunk_size
        chunked, self.chunked = self.chunked, None
        num_running = len(view.running) + (chunked is not None)
        picked: list[tuple[Req, int, int]] = []
        admitted: list[Req] = []
        jumped = [r for r in view.running if r.seq_len - r.kv_len > 1 and not view.parked(r)]
        for req in jumped + ([chunked] if chunked else []) + self.waiting:
            if budget <= 0:
                break
            is_new = req.row is None
            if req in jumped and req.seq_len - req.kv_len > budget:
                continue
            if is_new:
                if num_running + len(admitted) >= self.limits.max_running:
                    break
                if not kv.admit(req, budget, self._decode_reserve(view)):
                    break
            n = min(req.seq_len - req.kv_len, budget)
            if not kv.ensure_free(n):
                if is_new:
                    kv.release(req, cache=False)
                break
            if is_new:
                admitted.append(req)
                req.admitted_at = req.admitted_at or time.monotonic()  # queue-time metric
            # allocate now, so the next candidate's room check sees what this one took
            kv.write(req, req.kv_len, kv.alloc(n))
            if not req.output_ids:
                kv.publish(req, req.kv_len + n)
            picked.append((req, req.kv_len, req.kv_len + n))
            budget -= n
        if chunked is not None and all(r is not chunked for r, _, _ in picked):
            self.chunked = chunked
        if admitted:
            done = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in done]
        if picked and not admitted and chunked is None:
            # only jump-forward extends: let the rest of the running batch decode in the same pass
            # (a decode row is a 1-token extend) instead of waiting a step
            in_batch = {id(r) for r, _, _ in picked}
            for req in view.running:
                if (id(req) not in in_batch and req.seq_len - req.kv_len == 1 and not view.parked(req)
                        and kv.ensure_free(1)):
                    kv.write(req, req.kv_len, kv.alloc(1))
                    picked.append((req, req.kv_len, req.kv_len + 1))
        return picked

    @staticmethod
    def _decode_reserve(view: RunningView) -> int:
        # Room the running requests will need, times a learned ratio: most requests stop well
        # before max_new_tokens, so reserving all of it wastes the pool; retraction covers a
        # wrong guess, and each retraction makes the guess more careful.
        remaining = sum(r.params.max_new_tokens - len(r.output_ids) for r in view.running)
        return int(remaining * view.new_token_ratio)

    def _build(self, picked: list[tuple[Req, int, int]]) -> Batch:
        ids, logit_idx, scheduled, new_slots = [], [], [], []
        for req, start, end in picked:
            new_slots.append(self.kv.slots_of(req, end)[start:])
            base = len(ids) - start  # flattened row of position p is base + p
            ids += req.span(start, end)
            # logits: the last position of a complete prompt samples the next token; input
            # logprobs need every position from logprob_start_len - 1 on
            first = end
            if req.wants_input_logprobs and not req.output_ids:
                first = max(start, req.logprob_start_len - 1)
            if end == req.seq_len:
                first = min(first, end - 1)
            row0 = len(logit_idx)
            logit_idx += range(base + first, base + end)
            scheduled.append(ScheduledReq(req, start, end, list(range(row0, len(logit_idx))), first))
        plan = BatchPlan(ForwardMode.EXTEND, ids, torch.cat(new_slots), [r.row for r, _, _ in picked],
                         [start for _, start, _ in picked], [end - start for _, start, end in picked], logit_idx)
        return Batch(ForwardMode.EXTEND, scheduled, self.make_batch(plan))
