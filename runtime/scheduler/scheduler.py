"""Continuous-batching scheduler: one code path for the in-process Engine and the server process.

A step is three calls: `_schedule()` picks an extend (prefill) batch if waiting work fits, else a
decode batch; `runner.forward()` runs it; `_process()` samples, checks finish conditions and
returns StepOutputs. KV bookkeeping (matching, locking, caching, retraction) lives in KVManager.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from radixlm.constrained.base import GrammarError
from radixlm.radix_cache import RadixCache
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardMode
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.output.accumulator import make_step_output
from radixlm.runtime.output.finish import check_finish
from radixlm.runtime.request.healing import start_healing
from radixlm.runtime.request.req import FinishReason, Req, StepOutput
from radixlm.runtime.sampling.kernels import compute_logprobs, top_logprobs
from radixlm.runtime.sampling.step import sample_requests
from radixlm.runtime.scheduler.grammars import GrammarManager
from radixlm.runtime.scheduler.kv import KVManager
from radixlm.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

IN_BATCH_SHARE_MIN = 32  # defer a prefill sharing this many uncached tokens with one already in the batch
LPM_MAX_QUEUE = 128
NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_DECAY = 0.5, 0.1, 0.002


@dataclass(slots=True)
class ScheduledReq:
    req: Req
    start: int  # first new position
    end: int  # one past the last new position
    logit_rows: list[int]  # rows of the logits tensor that belong to this request
    logit_pos0: int  # position of the first of those rows


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner):
        self.args = args
        self.runner = runner
        self.cache = RadixCache(runner.allocator, disable=args.disable_radix_cache)
        self.kv = KVManager(runner, self.cache)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self._aborts: set[str] = set()
        self._pending: list[StepOutput] = []
        self.live: dict[str, Req] = {}  # every request not yet finished, wherever it is
        cfg_eos = getattr(runner.config, "eos_token_id", None)
        eos = set(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else [])
        if runner.tokenizer.eos_token_id is not None:
            eos.add(runner.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.grammars = GrammarManager(args.grammar_backend, runner.tokenizer, runner.vocab_size, self.eos_ids,
                                       jump_forward=not args.disable_jump_forward,
                                       compile_timeout=args.grammar_compile_timeout)
        self.forward_passes = 0
        self.decode_tokens = 0
        self.retractions = 0
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT

    # ---------------------------------------------------------------- public API
    def add_request(self, req: Req) -> None:
        self.live[req.rid] = req
        start_healing(req, self.runner.tokenizer)  # no-op unless params.token_healing
        if req.params.constraint is not None:
            self.grammars.submit(req)  # joins the waiting queue once its grammar compiled
        else:
            self.waiting.append(req)

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._pending or self._aborts
                    or self.grammars.pending)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    def step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        outputs += self._handle_aborts()
        outputs += self._resume_parked()
        if self.grammars.pending:
            ready, failed = self.grammars.poll()
            self.waiting += ready
            outputs += [make_step_output(r) for r in failed]
        batch = self._schedule()
        if batch:
            mode, scheduled, fb = batch
            logits = self.runner.forward(fb)
            self.forward_passes += 1
            outputs += self._process(mode, scheduled, logits)
        elif not outputs:
            self._wait_idle(timeout=0.05)  # only compiles or pattern checks are in flight: don't spin
        for out in outputs:
            if out.finish is not None:
                self.live.pop(out.rid, None)
        return outputs

    def _resume_parked(self) -> list[StepOutput]:
        """Requests whose pattern check finished: finish them or let them step again."""
        outputs = []
        for req in [r for r in self.running if r.parked is not None and r.parked.future.done()]:
            parked, req.parked = req.parked, None
            req.pattern_seconds += max(time.monotonic() - parked.since, 1e-6)
            try:
                req.finish = parked.resolve(parked.future.result())  # may park the request again
            except GrammarError as e:  # a client pattern past its bound
                req.finish = FinishReason("abort", message=f"{parked.source}: {e}", code=400, field=parked.source)
            except Exception as e:
                logger.warning("pattern check of %s failed: %s", req.rid, e)
                req.finish = FinishReason("abort", message=f"internal error in this request: {e}", code=500)
            if req.finished:
                outputs.append(self._finish(req))
        return outputs

    def _parked(self, req: Req) -> bool:
        """Waiting for a check of a client pattern (its stop_regex, its schema's end check)."""
        return req.parked is not None or (req.grammar is not None and self.grammars.busy(req) is not None)

    def _wait_idle(self, timeout: float) -> None:
        futures = [f for _, f, _ in self.grammars.pending] + [r.parked.future for r in self.running if r.parked]
        futures += [f for r in self.running if r.grammar is not None and (f := self.grammars.busy(r)) is not None]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def flush_cache(self) -> bool:
        """Drops the whole radix cache; refused (False) while requests hold KV."""
        if self.running or self.chunked:
            return False
        self.cache.reset()
        self.cache.reset_stats()
        return True

    def fail_all(self, message: str) -> list[StepOutput]:
        """After an internal error: finish every request with an abort and release its KV."""
        outs = []
        for req in self.live.values():
            if req.row is not None:
                try:
                    self.kv.release(req, cache=False)
                except Exception:  # KV state may be what broke; the reply matters more
                    logger.exception("releasing %s failed", req.rid)
            req.finish = FinishReason("abort", message=message)
            outs.append(make_step_output(req))
        self.waiting, self.running, self.chunked, self.live = [], [], None, {}
        self.grammars.pending = []
        return outs

    # ---------------------------------------------------------------- scheduling
    def _schedule(self):
        batch = self._schedule_extend()
        if batch is None and self.running:
            batch = self._schedule_decode()
        return batch

    def _order_waiting(self) -> None:
        if self.args.schedule_policy == "lpm" and 1 < len(self.waiting) <= LPM_MAX_QUEUE:
            prefix = {id(r): self.kv.peek_prefix_len(r) for r in self.waiting}
            self.waiting.sort(key=lambda r: -prefix[id(r)])  # stable: fcfs among equals

    def _schedule_extend(self):
        if not self.waiting and self.chunked is None and not any(r.seq_len - r.kv_len > 1 for r in self.running):
            return None
        self._order_waiting()
        budget = self.args.chunked_prefill_size
        chunked, self.chunked = self.chunked, None
        picked: list[tuple[Req, int, int]] = []
        admitted: list[Req] = []
        jumped = [r for r in self.running if r.seq_len - r.kv_len > 1 and not self._parked(r)]
        for req in jumped + ([chunked] if chunked else []) + self.waiting:
            if budget <= 0:
                break
            is_new = req.row is None
            if req in jumped and req.seq_len - req.kv_len > budget:
                continue
            if is_new:
                if self.num_running + len(admitted) >= self.args.max_running_requests:
                    break
                if picked and self._shares_uncached(req, picked):
                    continue  # prefill it next step, when the shared part is cached
                if not self.kv.admit(req, budget, self._decode_reserve()):
                    break
            n = min(req.seq_len - req.kv_len, budget)
            if not self.kv.ensure_free(n):
                if is_new:
                    self.kv.release(req, cache=False)
                break
            if is_new:
                admitted.append(req)
                req.admitted_at = req.admitted_at or time.monotonic()  # queue-time metric
            # allocate now, so the next candidate's room check sees what this one took
            self.kv.write(req, req.kv_len, self.kv.alloc(n))
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
            for req in self.running:
                if (id(req) not in in_batch and req.seq_len - req.kv_len == 1 and not self._parked(req)
                        and self.kv.ensure_free(1)):
                    self.kv.write(req, req.kv_len, self.kv.alloc(1))
                    picked.append((req, req.kv_len, req.kv_len + 1))
        return self._build_extend(picked) if picked else None

    def _shares_uncached(self, req: Req, picked: list[tuple[Req, int, int]]) -> bool:
        """True if req and a picked request share IN_BATCH_SHARE_MIN tokens past what is cached."""
        if self.cache.disable:
            return False
        seq = req.seq
        for other, start, _ in picked:
            n = start + IN_BATCH_SHARE_MIN
            if len(seq) >= n and len(other.input_ids) >= n and seq[:n] == other.input_ids[:n]:
                return True
        return False

    def _decode_reserve(self) -> int:
        # Room the running requests will need, times a learned ratio: most requests stop well
        # before max_new_tokens, so reserving all of it wastes the pool; retraction covers a
        # wrong guess, and each retraction makes the guess more careful.
        remaining = sum(r.params.max_new_tokens - len(r.output_ids) for r in self.running)
        return int(remaining * self.new_token_ratio)

    def _build_extend(self, picked: list[tuple[Req, int, int]]):
        ids, logit_idx, scheduled, new_slots = [], [], [], []
        for req, start, end in picked:
            new_slots.append(self.kv.slots_of(req, end)[start:])
            seq = req.seq
            base = len(ids) - start  # flattened row of position p is base + p
            ids += seq[start:end]
            # logits: the last position of a complete prompt samples the next token; input
            # logprobs need every position from logprob_start_len - 1 on
            first = end
            if req.wants_input_logprobs and not req.output_ids:
                first = max(start, req.logprob_start_len - 1)
            if end == len(seq):
                first = min(first, end - 1)
            row0 = len(logit_idx)
            logit_idx += range(base + first, base + end)
            scheduled.append(ScheduledReq(req, start, end, list(range(row0, len(logit_idx))), first))
        plan = BatchPlan(ForwardMode.EXTEND, ids, torch.cat(new_slots), [r.row for r, _, _ in picked],
                         [start for _, start, _ in picked], [end - start for _, start, end in picked], logit_idx)
        return ForwardMode.EXTEND, scheduled, self.runner.make_batch(plan)

    def _schedule_decode(self):
        # a parked request takes no step (and is never retracted: its check's verdict is about
        # the tokens it holds)
        movable = [r for r in self.running if not self._parked(r)]
        while not self.kv.ensure_free(len(movable)):
            if len(self.running) == 1 and movable:
                req = self.running[0]
                req.finish = FinishReason("abort", message="KV pool exhausted: raise max_total_tokens")
                self._pending.append(self._finish(req))
                return None
            if not movable:
                return None
            victim = max(movable, key=lambda r: (r.params.max_new_tokens - len(r.output_ids), id(r)))
            self._retract(victim)
            movable.remove(victim)
        self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        decodable = [r for r in movable if r.seq_len - r.kv_len == 1]
        if not decodable:
            return None
        n = len(decodable)
        slots = self.kv.alloc(n)
        rows = [r.row for r in decodable]
        positions = [r.seq_len - 1 for r in decodable]
        self.kv.req_to_token.write_tokens(rows, positions, slots)
        scheduled = [ScheduledReq(r, p, p + 1, [i], p) for i, (r, p) in enumerate(zip(decodable, positions))]
        # a decodable request's only pending token is its last output
        plan = BatchPlan(ForwardMode.DECODE, [r.output_ids[-1] for r in decodable], slots, rows, positions,
                         [1] * n, list(range(n)))
        return ForwardMode.DECODE, scheduled, self.runner.make_batch(plan)

    def _retract(self, req: Req) -> None:
        """Gives a running request's KV back (into the cache) and requeues it; nothing is lost."""
        self.running.remove(req)
        self.kv.release(req, cache=True)
        req.retractions += 1
        self.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        self.waiting.insert(0, req)
        logger.debug("retracted %s at %d tokens", req.rid, req.seq_len)

    # ---------------------------------------------------------------- post-processing
    def _process(self, mode: ForwardMode, scheduled: list[ScheduledReq], logits: torch.Tensor):
        outputs: list[StepOutput] = []
        to_sample: list[tuple[ScheduledReq, int]] = []
        for sr in scheduled:
            req = sr.req
            req.kv_len = sr.end
            if mode is ForwardMode.EXTEND and req.wants_input_logprobs and not req.output_ids:
                self._collect_input_logprobs(sr, logits)
            if sr.end < req.seq_len:  # a chunk of a longer prompt: continue next step
                self.chunked = req
                continue
            if mode is ForwardMode.EXTEND and not req.output_ids:  # a prompt just finished prefill
                self.kv.cache_unfinished(req)
                if req.params.max_new_tokens == 0 or req.finished:
                    req.finish = req.finish or FinishReason("length", matched=None)
                    outputs.append(self._finish(req))
                    continue
            to_sample.append((sr, sr.logit_rows[-1]))
        if to_sample:
            outputs += self._sample_and_advance(to_sample, logits)
        return outputs

    def _collect_input_logprobs(self, sr: ScheduledReq, logits: torch.Tensor) -> None:
        req = sr.req
        n_in = len(req.input_ids)
        if not req.input_logprobs and sr.start <= req.logprob_start_len:
            req.input_logprobs = [None] if req.logprob_start_len == 0 else []
            req.input_top_logprobs = [None] if req.logprob_start_len == 0 else []
        rows, targets = [], []
        for k, row in enumerate(sr.logit_rows):
            p = sr.logit_pos0 + k
            if req.logprob_start_len <= p + 1 < n_in:
                rows.append(row)
                targets.append(req.input_ids[p + 1])
        if rows:
            lp = compute_logprobs(logits[rows], torch.tensor(targets, device=logits.device))
            req.input_logprobs += lp.tolist()
            if req.top_logprobs_num:  # SGLang's input_top_logprobs, aligned with input_logprobs
                req.input_top_logprobs += top_logprobs(logits[rows], req.top_logprobs_num)

    def _sample_and_advance(self, to_sample: list[tuple[ScheduledReq, int]], logits: torch.Tensor):
        reqs = [sr.req for sr, _ in to_sample]
        rows = [row for _, row in to_sample]
        if rows != list(range(logits.shape[0])):
            logits = logits[rows]
        out = sample_requests(reqs, logits, self.grammars, self.eos_ids)
        outputs = []
        for i, req in enumerate(reqs):
            token = out.next_ids[i]
            if token is not None:
                try:
                    self._advance(req, token, out, i)
                except Exception as e:  # a grammar, jump-forward or stop check of this request
                    logger.warning("request %s failed after sampling: %s", req.rid, e)
                    req.finish = FinishReason("abort", message=f"internal error in this request: {e}", code=500)
            if req.finished:
                outputs.append(self._finish(req))
            else:
                if req not in self.running:
                    self.running.append(req)
                if req.stream or len(req.output_ids) == 1:  # the first token always: TTFT metrics
                    outputs.append(make_step_output(req))
        return outputs

    def _advance(self, req: Req, token: int, out, i: int) -> None:
        req.output_ids.append(token)
        if req.return_logprob:
            req.output_logprobs.append(out.logprobs[i])
            if req.top_logprobs_num:
                req.output_top_logprobs.append(out.top_logprobs[i] if out.top_logprobs else [])
        self.decode_tokens += 1
        if req.grammar is not None:
            req.finish = self.grammars.advance(req, token)
            if req.finish is None:
                self.grammars.jump_forward(req)
        req.finish = req.finish or check_finish(req, self.eos_ids, self.runner)

    def _finish(self, req: Req) -> StepOutput:
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.kv.release(req, cache=True)
        return make_step_output(req)

    def _handle_aborts(self) -> list[StepOutput]:
        if not self._aborts:
            return []
        outs = []
        pool: Iterable[Req] = list(self.waiting) + list(self.running) + ([self.chunked] if self.chunked else [])
        for rid in self._aborts:
            compiling = self.grammars.remove(rid)
            if compiling is not None:
                compiling.finish = FinishReason("abort", message="aborted")
                outs.append(make_step_output(compiling))
        for req in pool:
            if req.rid in self._aborts:
                req.finish = FinishReason("abort", message="aborted")
                if req in self.waiting:
                    self.waiting.remove(req)
                if req.row is not None:
                    outs.append(self._finish(req))
                else:
                    outs.append(make_step_output(req))
        self._aborts.clear()
        return outs
