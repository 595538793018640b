"""The radix cache's own history for people: hit rate over recent time windows, and evictions with
their reasons. Both are bounded (a fixed number of buckets or records) and cost O(1) per event, so
they can sit on the scheduler's hot path."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

WINDOWS_S = (60, 300, 900)  # the hit-rate windows GET /cache reports ("1m", "5m", "15m")
BUCKET_S = 5  # hit counts are kept per 5-second bucket: 180 buckets cover the longest window
RECENT_EVICTIONS = 32


class HitWindows:
    """Hit and queried prompt tokens per BUCKET_S bucket over the last max(WINDOWS_S) seconds."""

    def __init__(self) -> None:
        self._buckets: deque[list[int]] = deque(maxlen=max(WINDOWS_S) // BUCKET_S)  # [bucket start, hit, query]

    def add(self, hit: int, query: int, now: float | None = None) -> None:
        start = int((time.time() if now is None else now) // BUCKET_S) * BUCKET_S
        if self._buckets and self._buckets[-1][0] == start:
            bucket = self._buckets[-1]
            bucket[1] += hit
            bucket[2] += query
        else:
            self._buckets.append([start, hit, query])

    def rates(self, now: float | None = None) -> dict[str, dict]:
        """{"1m": {"hit_tokens", "query_tokens", "hit_rate"}, "5m": ..., "15m": ...}."""
        now = time.time() if now is None else now
        out = {}
        for window in WINDOWS_S:
            hit = query = 0
            for start, h, q in self._buckets:
                if start + BUCKET_S > now - window:
                    hit += h
                    query += q
            out[f"{window // 60}m"] = {"hit_tokens": hit, "query_tokens": query,
                                       "hit_rate": hit / query if query else None}
        return out

    def clear(self) -> None:
        self._buckets.clear()


@dataclass(slots=True)
class EvictionCount:
    events: int = 0  # evict() calls (or resets) that freed something
    nodes: int = 0
    tokens: int = 0


class EvictionLog:
    """Evicted tokens and nodes by reason since start, and the last RECENT_EVICTIONS events.

    Reasons the runtime gives: "admission" (a new request needed room), "capacity" (running requests
    needed room), "flush" (flush_cache)."""

    def __init__(self) -> None:
        self.by_reason: dict[str, EvictionCount] = {}
        self.recent: deque[tuple[float, str, int, int]] = deque(maxlen=RECENT_EVICTIONS)

    def record(self, reason: str, nodes: int, tokens: int) -> None:
        if not tokens:
            return
        count = self.by_reason.setdefault(reason, EvictionCount())
        count.events += 1
        count.nodes += nodes
        count.tokens += tokens
        self.recent.append((time.time(), reason, nodes, tokens))

    def to_dict(self) -> dict:
        return {
            "tokens": sum(c.tokens for c in self.by_reason.values()),
            "by_reason": {r: {"events": c.events, "nodes": c.nodes, "tokens": c.tokens}
                          for r, c in sorted(self.by_reason.items())},
            "recent": [{"time": t, "reason": r, "nodes": n, "tokens": k} for t, r, n, k in reversed(self.recent)],
        }
