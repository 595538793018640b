"""Continuous-batching scheduler: one code path for the in-process Engine and the server process.

A step is three calls. ``schedule()`` (host only) picks an extend (prefill) batch if waiting work
fits (``prefill.py``), else a decode batch, allocates its KV and returns a Batch on the model's
device. ``launch(batch)`` runs the forward and samples on the logits' device; the ids stay there.
``resolve(batch, launched)`` copies the ids back, advances grammars, checks stops and finishes,
and returns StepOutputs. KV bookkeeping (matching, locking, caching, retraction) lives in
``kv.py``. Before the three calls, ``step()`` ends aborted requests and resumes those parked on a
pattern check.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Iterable

from radixlm.constrained.base import GrammarError
from radixlm.radix_cache import RadixCache
from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.compute_thread import Task
from radixlm.runtime.executor.forward_batch import BatchPlan, ForwardMode
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.output.accumulator import make_step_output
from radixlm.runtime.output.finish import check_finish
from radixlm.runtime.request.healing import start_healing
from radixlm.runtime.request.req import FinishReason, Req, StepOutput
from radixlm.runtime.sampling.kernels import rows_token_logprobs, top_logprobs
from radixlm.runtime.sampling.running import RunningSampling
from radixlm.runtime.sampling.step import sample_on_device
from radixlm.runtime.scheduler.batch import Batch, Launched, ScheduledReq
from radixlm.runtime.scheduler.grammars import GrammarManager
from radixlm.runtime.scheduler.kv import KVManager
from radixlm.runtime.scheduler.overlap import Overlap, follow_inputs
from radixlm.runtime.scheduler.prefill import AdmissionLimits, PrefillAdmission, RunningView

logger = logging.getLogger(__name__)

NEW_TOKEN_RATIO_INIT, NEW_TOKEN_RATIO_MIN, NEW_TOKEN_RATIO_DECAY = 0.5, 0.1, 0.002


class Scheduler:
    def __init__(self, args: EngineArgs, runner: ModelRunner):
        self.args = args
        self.runner = runner
        self.cache = RadixCache(runner.allocator, disable=args.disable_radix_cache)
        self.kv = KVManager(runner, self.cache)
        self.running: list[Req] = []
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
        self.overlapped_steps = 0  # steps launched while the one before them was still running
        # the pool and tree checked whenever the loop goes idle, in debug mode (RADIXLM_DEBUG_KV=1):
        # "ok" or the first thing found broken (it stays)
        self.kv_check: str | None = "ok" if runner.allocator.debug else None
        self.retractions = 0
        self.new_token_ratio = NEW_TOKEN_RATIO_INIT
        self.prefill = PrefillAdmission(self.kv, runner.make_batch, AdmissionLimits(
            args.schedule_policy, args.chunked_prefill_size, args.max_running_requests))
        self.sampling_state = RunningSampling(runner.vocab_size, runner.device, self.eos_ids)
        self.overlap = Overlap(runner, self.grammars, self.kv, self.sampling_state, self.launch, self.decode_batch,
                               self.parked, enabled=not args.disable_overlap_schedule)
        self._inflight: tuple[Batch, Task] | None = None  # a launched step not yet resolved

    # ---------------------------------------------------------------- public API
    @property
    def waiting(self) -> list[Req]:
        """Requests queued for their prefill (admission owns the queue and its order)."""
        return self.prefill.waiting

    @waiting.setter
    def waiting(self, reqs: list[Req]) -> None:
        self.prefill.waiting = reqs

    @property
    def chunked(self) -> Req | None:
        """The request whose prompt is being prefilled in chunks, between its chunks."""
        return self.prefill.chunked

    @chunked.setter
    def chunked(self, req: Req | None) -> None:
        self.prefill.chunked = req

    def add_request(self, req: Req) -> None:
        self.live[req.rid] = req
        start_healing(req, self.runner.tokenizer)  # no-op unless params.token_healing
        if req.params.constraint is not None:
            self.grammars.submit(req)  # joins the waiting queue once its grammar compiled
            return
        req.grammar = self.grammars.with_rules(req, req.grammar)  # allowed_token_ids, bad_words
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        self._aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.has_pending_outputs()
                    or self.grammars.pending or self._inflight is not None)

    def has_pending_outputs(self) -> bool:
        """Aborts to handle or finishes to report: the next step must start from the host."""
        return bool(self._pending or self._aborts)

    @property
    def num_running(self) -> int:
        return len(self.running) + (self.chunked is not None)

    @property
    def num_waiting(self) -> int:
        """Queued requests, those still waiting for their grammar's compile included."""
        return len(self.waiting) + len(self.grammars.pending)

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        if self._inflight is not None:
            outputs += self._step_inflight()
            if self._inflight is not None:  # the next step was launched beside it: done for now
                return self._forget_finished(outputs)
        outputs, self._pending = outputs + self._pending, []
        outputs += self._handle_aborts()
        outputs += self._resume_parked()
        outputs += self._poll_grammars()
        batch = self.schedule()
        if batch is not None and self.overlap.enabled and self.overlap.may_follow(batch, self.running):
            self._inflight = (batch, self.overlap.submit(batch))  # resolved by the next step()
        elif batch is not None:
            outputs += self.resolve(batch, self.overlap.launch_now(batch))  # masks filled beside the forward
        elif not outputs:
            self._wait_idle(timeout=0.05)  # only compiles or pattern checks are in flight: don't spin
        return self._forget_finished(outputs)

    def _step_inflight(self) -> list[StepOutput]:
        """Resolves the step in flight, launching the next decode step first when it can overlap."""
        batch, future = self._inflight
        outputs = self._poll_grammars()  # compiles that finished meanwhile: their prefill comes next
        following = None
        if not (self.waiting or self.chunked is not None or self.has_pending_outputs()):  # else the host goes first
            following = self.overlap.next_decode(batch, future, self.running)
        if following is not None:
            self.note_decode_step()
        self._inflight = None if following is None else (following, self.overlap.submit(following))
        self.overlapped_steps += following is not None
        try:
            return outputs + self.resolve(batch, future.result())
        finally:  # N's tokens are in the grammars: N+1's masks, while its forward runs (it waits for them)
            if following is not None and following.masks is not None:
                following.masks.run_here()

    def _poll_grammars(self) -> list[StepOutput]:
        """Requests whose grammar compiled join the queue; those whose compile failed are reported."""
        if not self.grammars.pending:
            return []
        ready, failed = self.grammars.poll()
        self.waiting += ready
        return [make_step_output(r) for r in failed]

    def _forget_finished(self, outputs: list[StepOutput]) -> list[StepOutput]:
        for out in outputs:
            if out.finish is not None:
                self.live.pop(out.rid, None)
        if self.kv_check == "ok" and not self.has_work():
            self.kv_check = self.kv.check_idle()
            if self.kv_check != "ok":
                logger.error("KV accounting broken while idle: %s", self.kv_check)
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

    def parked(self, req: Req) -> bool:
        """Waiting for a check of a client pattern (its stop_regex, its schema's end check)."""
        return req.parked is not None or (req.grammar is not None and self.grammars.busy(req) is not None)

    def _wait_idle(self, timeout: float) -> None:
        futures = [f for _, f, _ in self.grammars.pending] + [r.parked.future for r in self.running if r.parked]
        futures += [f for r in self.running if r.grammar is not None and (f := self.grammars.busy(r)) is not None]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def settle(self) -> list[StepOutput]:
        """Resolves a step in flight whose rows all finished while it ran (it draws nothing anyone
        gets), so that what is answered between steps (server_info, flush_cache) sees its slots free:
        a client that got its last token must not find the pool still short of them."""
        if self._inflight is None or any(sr.req.row is not None for sr in self._inflight[0].scheduled):
            return []
        batch, future = self._inflight
        self._inflight = None
        try:
            launched = future.result()
        except Exception:  # nobody waits for its rows any more: only its slots are left to free
            logger.exception("a step whose requests had all finished failed")
            self.kv.allocator.free(batch.out_slots)
            return []
        return self._forget_finished(self.resolve(batch, launched))

    def flush_cache(self) -> bool:
        """Drops the whole radix cache; refused (False) while requests hold KV."""
        if self.running or self.chunked or self._inflight is not None:
            return False
        self.cache.reset()
        self.cache.reset_stats()
        return True

    def fail_all(self, message: str, step_failed: bool = False) -> list[StepOutput]:
        """Finishes every request with an abort and releases its KV (at a stop, or after an internal
        error: `step_failed` also empties the radix cache)."""
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
        if self._inflight is not None:  # its forward may still write its slots: let it end first
            self._inflight[1].exception()
            self._inflight = None
        if step_failed:  # prompts published for the step that failed are cached with K/V it may never have written
            try:
                self.cache.reset()
            except Exception:
                logger.exception("emptying the radix cache failed")
        try:  # slots of the step that failed and of one launched behind it, never resolved
            if lost := self.kv.reclaim_unowned():
                logger.warning("freed %d KV slots of unresolved steps", lost)
        except Exception:
            logger.exception("reclaiming KV slots failed")
        return outs

    # ---------------------------------------------------------------- the three calls
    def schedule(self) -> Batch | None:
        """This step's batch (host work only: admission, KV allocation, the batch plan), or None."""
        batch = self.prefill.schedule(RunningView(self.running, self.parked, self.new_token_ratio))
        if batch is None and self.running:
            batch = self._schedule_decode()
        if batch is not None and batch.mode is ForwardMode.DECODE:
            batch.sampling_batch = self.sampling_state.for_rows([sr.req for sr in batch.sampling])
        return batch

    def launch(self, batch: Batch) -> Launched:
        """The forward, then sampling on the logits' device (grammar masks included): nothing
        comes back to the host but what a mask or a top-logprobs list needs."""
        if batch.follows is not None:
            follow_inputs(batch)
        logits = self.runner.forward(batch.forward)
        self.forward_passes += 1
        sampled = None
        if batch.sampling:
            if batch.mode is ForwardMode.DECODE and len(batch.sampling) == logits.shape[0]:
                picked = logits  # a decode step's row i is request i's only logits row
            else:
                rows = [sr.logit_rows[-1] for sr in batch.sampling]
                picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
            sampled = sample_on_device([sr.req for sr in batch.sampling], picked, self.grammars, self.eos_ids,
                                       prebuilt=batch.sampling_batch, masks=batch.masks).start_copy()
        return Launched(logits, sampled)

    def resolve(self, batch: Batch, launched: Launched) -> list[StepOutput]:
        """The step's results on the host: KV lengths, input logprobs, finished prefills, then each
        drawn token through grammars, stops and finish checks."""
        extend = batch.mode is ForwardMode.EXTEND
        dropped: set[int] = set()
        for k, sr in enumerate(batch.scheduled):
            req = sr.req
            # finished, aborted, parked or jumped forward while this overlapped step ran: its token is
            # dropped and its slot freed (a row that goes on computes the position again)
            if req.row is None or not extend and (req.seq_len != sr.end or self.parked(req)
                                                  or id(sr) in batch.unmasked):
                self.kv.allocator.free(batch.out_slots[k : k + 1])
                dropped.add(id(sr))
            else:
                req.kv_len = sr.end
        # a decode step's rows each drew their one new token: nothing else to settle before the draws
        outputs = self._settle_extend(batch, launched, dropped) if extend else []
        if launched.sampled is not None:
            outputs += self._advance_all(batch.sampling, launched.sampled.host(), dropped, joining=extend)
        return outputs

    def _settle_extend(self, batch: Batch, launched: Launched, dropped: set[int]) -> list[StepOutput]:
        """An extend step's rows: input logprobs, chunks that continue, prompts that finished prefill."""
        outputs: list[StepOutput] = []
        drew = {id(sr) for sr in batch.sampling}  # decided when scheduled (a failed mask sets finish since)
        for sr in batch.scheduled:
            req = sr.req
            if id(sr) in dropped:
                continue
            if req.wants_input_logprobs and not req.output_ids:
                sr.collect_input_logprobs(launched.logits)
            if sr.end < req.seq_len:  # a chunk of a longer prompt: continue next step
                self.chunked = req
                continue
            if not req.output_ids:  # a prompt just finished prefill
                self.kv.cache_unfinished(req)
                if id(sr) not in drew:  # max_new_tokens == 0 (or it already failed)
                    if req.finish is None and req.return_logprob and (req.top_logprobs_num or req.token_ids_logprob):
                        # as SGLang: a prompt-only request reports the next position's top-k (and asked ids)
                        row = launched.logits[sr.logit_rows[-1:]]
                        if req.top_logprobs_num:
                            req.output_top_logprobs = top_logprobs(row, req.top_logprobs_num)
                        if req.token_ids_logprob:
                            req.output_token_ids_logprobs = rows_token_logprobs(row, req.token_ids_logprob)
                    req.finish = req.finish or FinishReason("length", matched=None)
                    outputs.append(self._finish(req))
        return outputs

    def _schedule_decode(self):
        # a parked request takes no step (and is never retracted: its check's verdict is about
        # the tokens it holds)
        movable = [r for r in self.running if not self.parked(r)]
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
        self.note_decode_step()
        decodable = [r for r in movable if r.seq_len - r.kv_len == 1]
        if not decodable:
            return None
        # a decodable request's only pending token is its last output
        return self.decode_batch(decodable, [r.seq_len - 1 for r in decodable], [r.output_ids[-1] for r in decodable])

    def note_decode_step(self) -> None:
        """Every decode step makes the admission reserve less careful (_retract makes it more)."""
        self.new_token_ratio = max(NEW_TOKEN_RATIO_MIN, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def decode_batch(self, reqs: list[Req], positions: list[int], input_ids: list[int]) -> Batch:
        """A decode step of `reqs` (one new token each, at `positions`), its KV slots allocated (the
        batch's build writes them into the req->token table)."""
        n = len(reqs)
        slots = self.kv.alloc(n)
        rows = [r.row for r in reqs]
        scheduled = [ScheduledReq(r, p, p + 1, [i], p) for i, (r, p) in enumerate(zip(reqs, positions))]
        plan = BatchPlan(ForwardMode.DECODE, input_ids, slots, rows, positions, [1] * n, list(range(n)))
        batch = Batch(ForwardMode.DECODE, scheduled, self.runner.make_batch(plan))
        batch.out_slots = slots
        return batch

    def _retract(self, req: Req) -> None:
        """Gives a running request's KV back (into the cache) and requeues it; nothing is lost."""
        self.running.remove(req)
        self.kv.release(req, cache=True)
        req.retractions += 1
        self.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)
        self.waiting.insert(0, req)
        logger.debug("retracted %s at %d tokens", req.rid, req.seq_len)

    # ---------------------------------------------------------------- resolve's parts
    def _advance_all(self, sampling: list[ScheduledReq], out, dropped: set[int], joining: bool) -> list[StepOutput]:
        """Each drawn token through its request's checks. `joining`: rows of an extend step, which
        join the running batch here (a decode step's rows are in it: no scan of it per row)."""
        outputs = []
        ids = out.next_ids
        for i, sr in enumerate(sampling):
            req = sr.req
            if dropped and id(sr) in dropped:
                continue
            token = ids[i]
            if token is not None:
                try:
                    self._advance(req, token, out, i)
                except Exception as e:  # a grammar, jump-forward or stop check of this request
                    logger.warning("request %s failed after sampling: %s", req.rid, e)
                    req.finish = FinishReason("abort", message=f"internal error in this request: {e}", code=500)
            if req.finish is not None:
                outputs.append(self._finish(req))
            else:
                if joining and req not in self.running:
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
            if req.token_ids_logprob:
                req.output_token_ids_logprobs.append(out.token_ids_logprobs[i] if out.token_ids_logprobs else [])
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

