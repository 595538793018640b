"""The scheduler's cache control calls: the tree summarised (GET /cache, /cache/tree) and KV snapshots
(POST /cache/save|load, Engine.save_cache/load_cache). They reach the scheduler thread the way
flush_cache does (the driver's Call), so nothing reads or changes the tree from another thread.

Summaries carry token ids (`head_ids`), never text: the caller decodes them off the scheduler thread
(`decode_heads`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# bounds on what one call may ask for (the HTTP routes refuse values past them with a 400)
MAX_TOP = 100
MAX_DEPTH = 64
MAX_TREE_NODES = 5000


class CacheCalls:
    def __init__(self, scheduler, args) -> None:
        # imported here: they need torch, and the HTTP process imports this module for its bounds only
        from radixlm.radix_cache import report
        from radixlm.runtime.scheduler.snapshot import CacheSnapshots

        self.s = scheduler
        self.report = report
        self.snapshots = CacheSnapshots(scheduler, args)

    def table(self) -> dict[str, Callable[..., Any]]:
        """The driver's control calls this module answers (a Future: the answer comes later)."""
        return {"cache_summary": self.summary, "cache_tree": self.tree, "cache_save": self.snapshots.save,
                "cache_load": self.snapshots.load}

    def summary(self, top: int = 10) -> dict:
        s = self.s
        alloc = s.runner.allocator
        out = self.report.summary(s.cache, top=min(max(top, 0), MAX_TOP))
        out.update(pool_tokens=alloc.num_slots, free_tokens=alloc.num_free,
                   running_tokens=alloc.num_slots - alloc.num_free - s.cache.total_size,
                   num_running=s.num_running, num_waiting=s.num_waiting,
                   disabled=s.cache.disable, snapshot=self.snapshots.info())
        return out

    def tree(self, depth: int = 8, min_tokens: int = 0, max_nodes: int = 500) -> dict:
        return self.report.tree(self.s.cache, depth=min(max(depth, 1), MAX_DEPTH), min_tokens=max(min_tokens, 0),
                           max_nodes=min(max(max_nodes, 1), MAX_TREE_NODES))


def decode_heads(answer: dict, tokenizer) -> dict:
    """Replaces the `head_ids` (and `tail_ids`) lists of a summary's prefixes or a tree's nodes by
    `text` (and `tail`), decoded with special tokens kept: they show where a chat turn starts. In
    place; returns `answer`."""
    items = answer["top_prefixes"] if "top_prefixes" in answer else answer["nodes"]
    for key, out in (("head_ids", "text"), ("tail_ids", "tail")):
        holders = [item for item in items if key in item]
        ids = [item.pop(key) for item in holders]
        for item, text in zip(holders, tokenizer.batch_decode(ids, skip_special_tokens=False) if ids else []):
            item[out] = text
    return answer
