"""The continuous-batching scheduler: which requests run this step, and what happens after it.

``scheduler.py`` is the loop's step (admission in LPM order with in-batch deferral and chunked
prefill, decode, retraction when the pool runs dry, finishing and outputs); ``kv.py`` the KV
bookkeeping over the radix cache (match, lock, allocate, cache and release a request's slots);
``grammars.py`` constrained decoding inside the loop (compile queue, masks, jump-forward, the
end check's parked verdicts).
"""

from typing import Any

__all__ = ["Scheduler"]


def __getattr__(name: str) -> Any:
    """`Scheduler`, imported on first use: the HTTP process imports `cache_calls` from this package
    and never the scheduler (nor torch)."""
    if name == "Scheduler":
        from radixlm.runtime.scheduler.scheduler import Scheduler

        return Scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
