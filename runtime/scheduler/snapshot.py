"""KV snapshots: the hottest part of the radix cache saved to a file and loaded back, so a restart
keeps its warm prefixes (snapshot_file.py has the format; `--cache-snapshot PATH` and
`--cache-snapshot-max-tokens` choose the file and the budget).

Threads. Whatever touches the tree or the allocator runs on the scheduler thread: the driver calls
`pump()` once per loop iteration. Saving: the scheduler thread picks the nodes (hottest first) and
notes their slots; a writer thread reads those rows from the KV pool and writes the file, then asks
the scheduler thread (through `pump`) which nodes stayed in the cache all along. A node that did
kept its slots the whole time (the tree's slots are never rewritten; only eviction or a flush frees
them, and those detach the node), so its rows are sound; the others are marked invalid. No lock is
held and the scheduler never waits for the disk. Loading: a reader thread reads and verifies the
whole file; then the scheduler thread inserts it LOAD_CHUNK_TOKENS at a time (allocate, copy rows
into the pool, insert), hottest first and into free slots only (a load never evicts), so no step
waits long. At start-up and shutdown the same work runs to the end on the calling thread, before
the first request or after the last. On CUDA every copy is queued on the one stream the forwards
use, so a batch never reads rows before they land.

A snapshot is used only if its fingerprint (snapshot_file.fingerprint) matches this server's;
anything else is refused with one log line, and nothing from it is used.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixlm.radix_cache.report import Kept, hottest
from radixlm.runtime.executor.compute_thread import keep_off_openmp
from radixlm.runtime.scheduler.snapshot_file import (
    SnapshotData,
    SnapshotError,
    fingerprint,
    read_snapshot,
    write_snapshot,
)

logger = logging.getLogger(__name__)

LOAD_CHUNK_TOKENS = 2048  # tokens a runtime load copies into the pool per loop iteration
BACKGROUND_NICENESS = 10  # the writer or reader thread, while requests run: the steps keep the CPU
# A save or a read still running after this is abandoned (a disk that stopped answering): its record
# says so, the busy flag is freed and whatever the thread does later is discarded.
DEADLINE_S = 600.0


def _in_thread(fn, name: str, nice: bool) -> cf.Future:
    """fn() on a daemon thread (a stuck disk never keeps the process from exiting); with `nice`, at
    a lower priority. Saves and loads go nice while the scheduler has work, so steps keep their share
    of a busy CPU and the file waits; on an idle server they run at full speed."""
    future: cf.Future = cf.Future()

    def run() -> None:
        keep_off_openmp()
        if nice:
            try:  # Linux schedules threads as tasks: this one's niceness leaves the others alone
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
            except (AttributeError, OSError):
                pass
        try:
            future.set_result(fn())
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


@dataclass(slots=True)
class _Save:
    path: Path
    kept: list[Kept]
    started: float
    asked: threading.Event = field(default_factory=threading.Event)  # the writer read every row
    answer: cf.Future = field(default_factory=cf.Future)  # which kept nodes stayed in the cache
    writer: cf.Future | None = None
    reply: cf.Future = field(default_factory=cf.Future)


@dataclass(slots=True)
class _Load:
    path: Path
    started: float
    reader: cf.Future
    data: SnapshotData | None = None
    usable: list[bool] = field(default_factory=list)  # valid, and so is its parent
    starts: list[int] = field(default_factory=list)  # each node's first row
    next: int = 0  # the node being inserted
    tokens: int = 0  # inserted so far (new to the cache)
    pool_full: bool = False
    verified: float = 0.0  # when the read and the checks were done (monotonic)
    reply: cf.Future = field(default_factory=cf.Future)


class CacheSnapshots:
    """Saves and loads snapshots for one Scheduler; every method runs on the scheduler thread.

    Every outcome is a record (a dict with `ok`; on failure `error`, a SnapshotError kind, and
    `message`); save() and load() return it, or a Future of it while the work goes on."""

    def __init__(self, scheduler, args) -> None:
        self.s = scheduler
        self.args = args
        self.path = Path(args.cache_snapshot) if args.cache_snapshot else None
        self.max_tokens = args.cache_snapshot_max_tokens
        self._fingerprint: dict[str, str] | None = None
        self._save: _Save | None = None
        self._load: _Load | None = None
        self.last: dict[str, dict] = {}  # "last_save" / "last_load" -> its record (GET /cache)

    @property
    def busy(self) -> bool:
        return self._save is not None or self._load is not None

    def fingerprint(self) -> dict[str, str]:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.s.runner, self.args)
        return self._fingerprint

    def info(self) -> dict:
        return {"configured": self.path is not None, "max_tokens": self.max_tokens,
                "busy": "save" if self._save else "load" if self._load else None, **self.last}

    # ---------------------------------------------------------------- saving
    def save(self, path: str | None = None) -> cf.Future | dict:
        """Starts a save to `path` (default: --cache-snapshot)."""
        try:
            target = self._target(path, "save")
            kept, table = self._plan()
        except SnapshotError as e:
            return _failure(e)
        if not kept:
            return _nothing_cached(target)
        job = _Save(target, kept, time.monotonic())
        pool = self.s.runner.kv_pool
        slots = _slots(kept)
        fp = self.fingerprint()

        def check_valid() -> list[bool]:  # on the writer thread: the answer comes from pump()
            job.asked.set()
            return job.answer.result(timeout=600)

        job.writer = _in_thread(lambda: write_snapshot(target, pool.k, pool.v, slots, table, fp, check_valid),
                                "radixlm-snapshot-save", nice=self.s.has_work())
        self._save = job
        return job.reply

    def save_now(self, path: str | None = None) -> dict:
        """A whole save, returning when the file is written (at shutdown: a load still reading its
        file is abandoned, not waited for)."""
        if self._load is not None and not self._load.reader.done():
            self._abandon_load("the server is stopping")
        self.wait()
        record = self.save(path)
        if isinstance(record, cf.Future):
            self.wait()  # pumps: answers the writer's question, then finishes the job
            return record.result()
        if not record["ok"]:
            logger.warning("KV snapshot not saved: %s", record["message"])
        return record

    def _plan(self) -> tuple[list[Kept], dict[str, torch.Tensor]]:
        if self.s.cache.disable:
            raise SnapshotError("the radix cache is disabled (--disable-radix-cache): nothing to save", "disabled")
        kept = hottest(self.s.cache, self.max_tokens)
        tokens = [t for k in kept for t in k.node.key[: k.take]]
        return kept, {"tokens": torch.tensor(tokens, dtype=torch.int64),
                      "parents": torch.tensor([k.parent for k in kept], dtype=torch.int64),
                      "lengths": torch.tensor([k.take for k in kept], dtype=torch.int64),
                      "hits": torch.tensor([k.node.hits for k in kept], dtype=torch.int64)}

    def _saved(self, path: Path, start: float, figures: dict | None, error: BaseException | None) -> dict:
        """Records (for GET /cache) and logs how a save went."""
        if error is not None:
            logger.error("KV snapshot save to %s failed: %s", path, error)
            self.last["last_save"] = _failure(error)
            return self.last["last_save"]
        seconds = time.monotonic() - start
        logger.info("KV snapshot saved to %s: %d tokens in %d nodes, %.1f MiB, %.2fs", path, figures["tokens"],
                    figures["nodes"], figures["bytes"] / 2**20, seconds)
        self.last["last_save"] = {"ok": True, "time": time.time(), "seconds": round(seconds, 3), **figures}
        return self.last["last_save"]

    # ---------------------------------------------------------------- loading
    def load(self, path: str | None = None) -> cf.Future | dict:
        """Starts adding the snapshot at `path` (default: --cache-snapshot) to the cache. A refused
        file (error "refused") leaves the cache as it was: nothing is inserted before the whole
        file is verified."""
        try:
            target = self._target(path, "load")
            if self.s.cache.disable:
                raise SnapshotError("the radix cache is disabled (--disable-radix-cache)", "disabled")
        except SnapshotError as e:
            return _failure(e)
        pool = self.s.runner.kv_pool
        fp = self.fingerprint()
        reader = _in_thread(lambda: read_snapshot(target, fp, len(pool.k), tuple(pool.k[0].shape[1:]),
                                                  pool.k[0].dtype), "radixlm-snapshot-load",
                            nice=self.s.has_work())
        self._load = _Load(target, time.monotonic(), reader)
        return self._load.reply

    def load_now(self, path: str | None = None, missing_ok: bool = False) -> dict | None:
        """A whole load, returning when it is done (at start-up, before the scheduler loop runs: a
        refused file is logged and the server starts cold). None when there is no file and
        `missing_ok`."""
        target = self.path if path is None else Path(path)
        if missing_ok and target is not None and not target.exists():
            logger.info("no KV snapshot at %s yet: starting cold", target)
            return None
        pending = self.load(path)
        if isinstance(pending, dict):
            logger.warning("KV snapshot %s not loaded: %s", target, pending["message"])
            return pending

        def finish() -> None:
            try:
                self._load.reader.exception(timeout=DEADLINE_S)  # waits for the read
            except cf.TimeoutError:
                self._abandon_load(f"reading the file took more than {DEADLINE_S:g}s")
            while self._load is not None:
                self._pump_load(budget=None)

        # the copies into the pool on the thread that runs the model: another thread's torch ops
        # would start a second OpenMP pool (executor/compute_thread.py)
        self.s.runner.compute.run(finish)
        return pending.result()

    def _pump_load(self, budget: int | None) -> None:
        job = self._load
        if job is None or not job.reader.done():
            return
        try:
            if job.data is None:
                job.data = d = job.reader.result()
                job.verified = time.monotonic()
                for i, p in enumerate(d.parents):
                    job.usable.append(d.valid[i] and (p < 0 or job.usable[p]))
                job.starts = _starts(d.lengths)
            finished = self._insert(job, budget)
        except Exception as e:
            self._loaded(job, e)
        else:
            if finished:
                self._loaded(job, None)

    def _insert(self, job: _Load, budget: int | None) -> bool:
        """Inserts nodes until `budget` new tokens went into the pool; True when the file is done."""
        d = job.data
        spent = 0
        while job.next < len(d.parents):
            i = job.next
            if job.usable[i]:
                rows = _path_rows(d.parents, job.starts, d.lengths, i)
                added, done = self._insert_path(d, rows, d.hits[i], None if budget is None else budget - spent)
                spent += added
                job.tokens += added
                if done is None:  # no room left (locked by running work): keep what is in
                    job.pool_full = True
                    return True
                if not done:
                    return False
            job.next += 1
            if budget is not None and spent >= budget:
                return job.next >= len(d.parents)
        return True

    def _insert_path(self, d: SnapshotData, rows: torch.Tensor, hits: int, budget: int | None
                     ) -> tuple[int, bool | None]:
        """Caches the tokens of `rows` (a root-to-node path) with their K/V, at most `budget` new
        tokens. Returns (tokens added, whether the whole path is in; None: no free slot is left).

        Only free slots are used: a load never evicts, neither what was cached before it nor (which
        would undo the hottest-first order) what it loaded itself."""
        cache, kv = self.s.cache, self.s.kv
        tokens = d.tokens[rows].tolist()
        match = cache.match_prefix(tokens, record_stats=False)
        m = len(match.slots)
        end = len(tokens) if budget is None else min(len(tokens), m + max(budget, 1))
        end = min(end, m + kv.allocator.num_free)
        if end == m < len(tokens):
            return 0, None
        if end > m:
            slots = kv.alloc(end - m)
            self._copy(d, rows[m:end], slots)
            prefix = cache.insert(tokens[:end], torch.cat([match.slots, slots]))
            kv.allocator.free(slots[: max(prefix - m, 0)])  # nothing ran in between: always empty
        node = cache.match_prefix(tokens[:end], record_stats=False).last_node
        while node is not cache.root:  # the saved hits, so the next save finds the same hot part
            node.hits = max(node.hits, hits)
            node = node.parent
        return end - m, end == len(tokens)

    def _copy(self, d: SnapshotData, rows: torch.Tensor, slots: torch.Tensor) -> None:
        pool = self.s.runner.kv_pool
        device = pool.k[0].device
        r0 = int(rows[0])
        contiguous = int(rows[-1]) - r0 == len(rows) - 1
        slots = slots.to(device)
        for dst_list, src_list in ((pool.k, d.k), (pool.v, d.v)):
            for dst, src in zip(dst_list, src_list):
                piece = src[r0 : r0 + len(rows)] if contiguous else src[rows]
                dst.index_copy_(0, slots, piece.to(device))

    def _loaded(self, job: _Load, error: BaseException | None) -> None:
        """Records (for GET /cache), logs and answers how a load went."""
        self._load = None
        if job.data is not None:
            job.data.close()
        if error is not None:
            if isinstance(error, SnapshotError):
                logger.warning("KV snapshot %s refused, nothing from it is used: %s", job.path, error)
            else:
                logger.error("KV snapshot %s could not be loaded: %s", job.path, error)
            self.last["last_load"] = _failure(error)
        else:
            seconds = time.monotonic() - job.started
            kept = sum(job.usable)
            self.last["last_load"] = {"ok": True, "time": time.time(), "seconds": round(seconds, 3),
                                      "read_seconds": round(job.verified - job.started, 3), "tokens": job.tokens,
                                      "nodes": kept, "skipped_nodes": len(job.usable) - kept,
                                      "pool_full": job.pool_full}
            logger.info("KV snapshot loaded from %s: %d tokens new to the cache from %d nodes in %.2fs%s", job.path,
                        job.tokens, kept, seconds,
                        " (the KV pool filled up: the rest was left out)" if job.pool_full else "")
        job.reply.set_result(self.last["last_load"])

    # ---------------------------------------------------------------- the loop's part
    def pump(self) -> None:
        """Moves the jobs on (scheduler thread): answers the writer, finishes saves, inserts a
        chunk of a load, abandons a job past DEADLINE_S."""
        job = self._save
        if job is not None:
            if job.asked.is_set() and not job.answer.done():
                job.answer.set_result([self.s.cache.is_attached(k.node) for k in job.kept])
            if job.writer.done():
                self._save = None
                error = job.writer.exception()
                job.reply.set_result(self._saved(job.path, job.started, None if error else job.writer.result(),
                                                 error))
            elif time.monotonic() - job.started > DEADLINE_S:
                self._save = None
                late = SnapshotError(f"the save did not finish within {DEADLINE_S:g}s and was abandoned", "failed")
                if not job.answer.done():  # the writer, if it ever asks, stops and removes its temporary file
                    job.answer.set_exception(late)
                job.reply.set_result(self._saved(job.path, job.started, None, late))
        load = self._load
        if load is not None and not load.reader.done() and time.monotonic() - load.started > DEADLINE_S:
            self._abandon_load(f"reading the file took more than {DEADLINE_S:g}s")
        elif load is not None:
            self._pump_load(LOAD_CHUNK_TOKENS)

    def _abandon_load(self, why: str) -> None:
        """Gives up a load whose reader has not finished: answered now, the busy flag freed; what the
        reader returns later is closed unused."""
        job = self._load
        job.reader.add_done_callback(lambda f: None if f.exception() else f.result().close())
        self._loaded(job, SnapshotError(f"the load was abandoned: {why}", "failed"))

    def wait(self) -> None:
        """Runs the jobs in flight to their end (shutdown)."""
        while self.busy:
            self.pump()
            if self.busy:
                time.sleep(0.005)

    def _target(self, path: str | None, what: str) -> Path:
        if self.busy:
            raise SnapshotError(f"a snapshot {'save' if self._save else 'load'} is in progress; try again", "busy")
        if path is not None:
            return Path(path)
        if self.path is None:
            raise SnapshotError(f"no snapshot file to {what}: start the server with --cache-snapshot PATH",
                                "unconfigured")
        return self.path


def _failure(error: BaseException) -> dict:
    kind = error.kind if isinstance(error, SnapshotError) else "failed"
    return {"ok": False, "error": kind, "message": str(error), "time": time.time()}


def _nothing_cached(target: Path) -> dict:
    return {"ok": True, "tokens": 0, "nodes": 0, "time": time.time(),
            "message": f"nothing cached: {target} left as it is"}


def _slots(kept: list[Kept]) -> torch.Tensor:
    if not kept:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([k.node.value[: k.take] for k in kept]).cpu()


def _starts(lengths: list[int]) -> list[int]:
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += n
    return out


def _path_rows(parents: list[int], starts: list[int], lengths: list[int], i: int) -> torch.Tensor:
    """The snapshot rows of the root-to-node-i path, in order."""
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return torch.cat([torch.arange(starts[j], starts[j] + lengths[j]) for j in reversed(chain)])


__all__ = ["CacheSnapshots", "SnapshotError", "fingerprint"]
