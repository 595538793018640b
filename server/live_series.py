"""The last minutes of the server, for the cache page (GET /cache's `series`): TTFT, prompt-cache hit
rate and running / waiting requests per BUCKET_S bucket, in the HTTP process (fed by Metrics, which
sees every first token and every load report). Bounded: KEEP_S / BUCKET_S buckets."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

BUCKET_S = 5
KEEP_S = 900


@dataclass(slots=True)
class _Bucket:
    start: int
    ttft_count: int = 0
    ttft_sum: float = 0.0
    ttft_max: float = 0.0
    hit_tokens: int = 0
    query_tokens: int = 0
    running: int = 0  # the most seen in the bucket
    waiting: int = 0


class LiveSeries:
    def __init__(self) -> None:
        self._buckets: deque[_Bucket] = deque(maxlen=KEEP_S // BUCKET_S)
        self._load = (0, 0)  # running, waiting as last reported (a state: it holds until the next report)
        self._cumulative = (0, 0)  # the scheduler's hit / query tokens at its last report

    def _bucket(self, now: float | None) -> _Bucket:
        start = int((time.time() if now is None else now) // BUCKET_S) * BUCKET_S
        if not self._buckets or self._buckets[-1].start != start:
            running, waiting = self._load
            self._buckets.append(_Bucket(start, running=running, waiting=waiting))
        return self._buckets[-1]

    def first_token(self, seconds: float, now: float | None = None) -> None:
        b = self._bucket(now)
        b.ttft_count += 1
        b.ttft_sum += seconds
        b.ttft_max = max(b.ttft_max, seconds)

    def load(self, running: int, waiting: int, hit_tokens: int, query_tokens: int, now: float | None = None) -> None:
        b = self._bucket(now)
        b.running, b.waiting = max(b.running, running), max(b.waiting, waiting)
        self._load = (running, waiting)
        hit0, query0 = self._cumulative
        if hit_tokens >= hit0 and query_tokens >= query0:  # counters restart with a flushed cache
            b.hit_tokens += hit_tokens - hit0
            b.query_tokens += query_tokens - query0
        self._cumulative = (hit_tokens, query_tokens)

    def to_dict(self, now: float | None = None) -> dict:
        """One point per bucket from the oldest kept to now; a bucket with no report repeats the last
        running / waiting counts and has no TTFT or hit rate (null)."""
        now = time.time() if now is None else now
        points = []
        if self._buckets:
            by_start = {b.start: b for b in self._buckets}
            last = self._buckets[0]
            end = int(now // BUCKET_S) * BUCKET_S
            for start in range(max(self._buckets[0].start, end - KEEP_S + BUCKET_S), end + 1, BUCKET_S):
                b = by_start.get(start)
                if b is None:
                    points.append({"t": start, "ttft_avg": None, "ttft_max": None, "first_tokens": 0, "hit_rate": None,
                                   "running": last.running, "waiting": last.waiting})
                    continue
                last = b
                points.append({"t": start, "ttft_avg": b.ttft_sum / b.ttft_count if b.ttft_count else None,
                               "ttft_max": b.ttft_max if b.ttft_count else None, "first_tokens": b.ttft_count,
                               "hit_rate": b.hit_tokens / b.query_tokens if b.query_tokens else None,
                               "running": b.running, "waiting": b.waiting})
        return {"bucket_s": BUCKET_S, "points": points}
