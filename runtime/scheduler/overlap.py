"""The overlap schedule: while step N's forward runs, the host resolves step N-1 and schedules N+1.

Steps are launched on the runner's compute thread (`executor/compute_thread.py`; on the CPU torch
releases the GIL inside its ops, on CUDA the thread only enqueues kernels), in order, so step N+1's
forward always starts after step N's. A decode step scheduled while step N is in flight continues
N's rows: each row's input id is the id step N drew for it, copied on the device at launch (the
host never waits for it), its position is one past N's, and its sampling settings are fixed at
schedule time with the lengths the row will have (seeds and min_new_tokens count tokens, so they
need no ids).

Constrained rows overlap too, by delayed sampling (SGLang's way): step N+1's forward is launched
from N's draws, the host then resolves N (its tokens go through the grammars, stops, finishes) and
only after that fills N+1's masks (`Batch.masks`), while N+1's forward runs; N+1's sampling waits for
its masks alone. A row that finishes, parks on a pattern check or jumps forward at N drew at N+1 for
nothing: resolve drops that token and frees its slot (the row's next step recomputes the position).

Only steady decode overlaps. Whatever needs the host first runs unoverlapped, as SGLang does: a row
with token healing, a stop_regex (checks that may park it) or penalties (they read the ids), a row
parked or jumped forward (it re-extends), pending aborts, waiting or chunked prompts (a prefill comes
next), and a pool that would need a retraction. Rows that finish at step N anyway (their last
allowed token) are left out of N+1.

A step that is not overlapped still overlaps its own grammar work (`launch_with_masks`): the masks
of its constrained rows depend only on their grammars' states, which nothing changes before the
step is resolved, so the scheduler fills them while the forward runs and the sampling waits for
them. On a GPU the host's mask work then hides behind the device's forward instead of following it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from radixlm.runtime.executor.compute_thread import Task
from radixlm.runtime.executor.forward_batch import ForwardMode
from radixlm.runtime.executor.host_memory import int64s
from radixlm.runtime.request.req import Req
from radixlm.runtime.sampling.kernels import SamplingBatch
from radixlm.runtime.scheduler.batch import Batch, Launched

if TYPE_CHECKING:
    from radixlm.runtime.executor.model_runner import ModelRunner
    from radixlm.runtime.sampling.running import RunningSampling
    from radixlm.runtime.scheduler.grammars import GrammarManager
    from radixlm.runtime.scheduler.kv import KVManager


class Overlap:
    """How a step is launched on the compute thread: now (resolved right after, its masks filled
    beside its forward), or in flight while the host resolves the one before it (`enabled`)."""

    def __init__(self, runner: ModelRunner, grammars: GrammarManager, kv: KVManager, sampling: RunningSampling,
                 launch: Callable[[Batch], Launched], decode_batch: Callable[[list[Req], list[int], list[int]], Batch],
                 parked: Callable[[Req], bool], enabled: bool = True) -> None:
        self.runner, self.grammars, self.kv, self.sampling = runner, grammars, kv, sampling
        self.launch, self.decode_batch, self.parked = launch, decode_batch, parked
        self.enabled = enabled

    def _fill_masks_task(self, batch: Batch) -> Task:
        return Task(self.grammars.fill_masks, ([sr.req for sr in batch.sampling], self.runner.vocab_size,
                                               self.runner.device))

    def submit(self, batch: Batch) -> Task:
        """Launches a step on the compute thread. A step whose masks are not deferred (`next_decode`
        defers a following step's) gets them filled here, on this thread, while its forward runs."""
        fill = batch.masks is None and any(sr.req.grammar is not None for sr in batch.sampling)
        if fill:
            batch.masks = self._fill_masks_task(batch)
        task = self.runner.compute.submit(self.launch, batch)
        if fill:
            batch.masks.run_here()  # never raises: an error is kept for the launch, which waits on it
        return task

    def launch_now(self, batch: Batch) -> Launched:
        """Launches a step that is resolved right after it. When a row that draws has a grammar, its
        mask is filled on this (the scheduler's) thread while the forward runs on the compute thread,
        and the sampling waits for it (`Batch.masks`); a failure to fill reaches the launch, never a hang."""
        compute = self.runner.compute
        if all(sr.req.grammar is None for sr in batch.sampling):
            return compute.run(self.launch, batch)
        batch.masks = self._fill_masks_task(batch)
        if compute.on_it():
            batch.masks.run_here()
            return self.launch(batch)
        task = compute.submit(self.launch, batch)
        batch.masks.run_here()  # never raises: an error is kept for the launch, which waits on it
        return task.result()

    def may_follow(self, batch: Batch, running: list[Req]) -> bool:
        """Whether a next step could overlap this one: its rows need no host work between steps, and
        each of them draws (a decode step, or an extend of running requests only: the re-extends of
        jump-forward rows with the others' decodes). Others are launched and resolved at once."""
        if not all(self._simple(sr.req) for sr in batch.scheduled):
            return False
        if batch.mode is ForwardMode.DECODE:
            return True
        ids = {id(r) for r in running}
        return len(batch.sampling) == len(batch.scheduled) and all(
            id(sr.req) in ids and sr.end == sr.req.seq_len for sr in batch.scheduled)

    def next_decode(self, prev: Batch, prev_future: Task, running: list[Req]) -> Batch | None:
        """Step N+1 of `running` continuing step N in flight (a step `may_follow` allowed), or None
        when this step must wait for N. The scheduler asks only when no prefill, abort or report
        needs the host first."""
        rows, reqs = [], []
        in_prev = {id(sr.req): i for i, sr in enumerate(prev.scheduled)}
        context_len = self.runner.context_len
        for req in running:  # (_simple inline: this loop runs over every row every step)
            i = in_prev.get(id(req))
            p = req.params
            if (i is None or req.healing is not None or p.stop_regex or req.parked is not None or p.has_penalties
                    or req.seq_len != prev.scheduled[i].end or (req.grammar is not None and self.parked(req))):
                # a row that is not in flight, needs the host, or moved on (it jumped forward at the
                # step before N: it re-extends): no overlap this step
                return None
            # rows whose token of step N is their last whatever it is (length or context) stop there
            drawn = len(req.output_ids) + 1  # its outputs once step N's token is in
            if drawn < p.max_new_tokens and len(req.input_ids) + drawn < context_len:
                rows.append(i)
                reqs.append(req)
        if not reqs or not self.kv.ensure_free(len(reqs)):
            return None
        # input ids: placeholders until follow_inputs copies step N's draws in, on the compute thread
        batch = self.decode_batch(reqs, [prev.scheduled[i].end for i in rows], [0] * len(reqs))
        batch.follows = prev_future
        if rows != list(range(len(prev.scheduled))):  # else every row of N follows in order: no selection
            batch.follow_rows = int64s(rows).to(batch.forward.input_ids.device)
        # lengths as they will be after step N (no penalties here, so no ids are read)
        batch.sampling_batch = self.sampling.for_rows(reqs) or SamplingBatch.build(
            [r.params for r in reqs], [r.input_ids for r in reqs], [range(len(r.output_ids) + 1) for r in reqs],
            self.runner.vocab_size, batch.forward.input_ids.device, eos_ids=self.sampling.eos_ids)
        if any(r.grammar is not None for r in reqs):  # filled by fill_follow_masks once N is resolved
            batch.masks = Task(self._follow_masks, (batch,))
        return batch

    def _follow_masks(self, batch: Batch):
        """Step N+1's masks, with N's tokens accepted. Rows that finished, parked or jumped forward at
        N draw a token nobody reads (resolve drops it): they are left all-allowed."""
        wanted = [sr.req.row is not None and sr.req.finish is None and sr.req.seq_len == sr.end
                  and not self.parked(sr.req) for sr in batch.sampling]
        # a check on the pool may end before resolve asks again: the drop must follow this decision
        batch.unmasked = {id(sr) for sr, want in zip(batch.sampling, wanted) if not want}
        return self.grammars.fill_masks([sr.req for sr in batch.sampling], self.runner.vocab_size, self.runner.device,
                                        wanted)

    @staticmethod
    def _simple(req: Req) -> bool:
        p = req.params
        return req.healing is None and not p.stop_regex and req.parked is None and not p.has_penalties


def follow_inputs(batch: Batch) -> None:
    """On the compute thread, before step N+1's forward: its input ids are step N's draws."""
    prev: Launched = batch.follows.result()
    ids = prev.sampled.next_ids
    batch.forward.input_ids.copy_(ids if batch.follow_rows is None else ids.index_select(0, batch.follow_rows))

