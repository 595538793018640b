"""KV bookkeeping for requests: radix matching, admission, slot allocation, caching and release.

Ownership rule: a request's first `cached_len` positions are slots owned by the radix cache (and
locked by the request through `last_node`); positions from `cached_len` to `kv_len` are slots the
request owns and must either hand to the cache or free. A prompt's new tokens are handed to the cache
when they are scheduled (`publish`), so while their step runs `cached_len` may pass `kv_len`.
"""

from __future__ import annotations

import torch

from radixlm.radix_cache import RadixCache
from radixlm.runtime.request.req import Req


class KVManager:
    def __init__(self, runner, cache: RadixCache):
        self.allocator = runner.allocator
        self.req_to_token = runner.req_to_token
        self.cache = cache

    def match_limit(self, req: Req) -> int:
        # at least one token is always recomputed: its logits give the next token
        limit = req.seq_len - 1
        if req.wants_input_logprobs and not req.output_ids:
            # positions before logprob_start_len - 1 may come from the cache; later ones need logits
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    def peek_prefix_len(self, req: Req) -> int:
        return len(self.cache.match_prefix(req.prefix(self.match_limit(req)), record_stats=False).slots)

    def admit(self, req: Req, budget: int, reserve: int) -> bool:
        """Matches the cached prefix, locks it and takes a req_to_token row, if room allows."""
        if self.req_to_token.num_free == 0:
            return False
        match = self.cache.match_prefix(req.prefix(self.match_limit(req)), record_stats=False)
        self.cache.inc_lock(match.last_node)
        n_new = min(req.seq_len - len(match.slots), budget)
        if not self.ensure_free(n_new + reserve, reason="admission"):
            self.cache.dec_lock(match.last_node)
            return False
        req.row = self.req_to_token.alloc()
        self.req_to_token.write(req.row, 0, match.slots)
        req.kv_len = req.cached_len = len(match.slots)
        req.last_node = match.last_node
        if req.retractions == 0:
            req.cached_tokens = len(match.slots)
            self.cache.count_hit(match.last_node, len(match.slots), len(req.input_ids))
        return True

    def ensure_free(self, n: int, reason: str = "capacity") -> bool:
        """At least n free slots, evicting cached prefixes (logged under `reason`) if needed."""
        free = self.allocator.num_free
        if free < n:
            self.cache.evict(n - free, reason)
        return self.allocator.num_free >= n

    def alloc(self, n: int) -> torch.Tensor:
        return self.allocator.alloc(n)

    def write(self, req: Req, start: int, slots: torch.Tensor) -> None:
        """Slots of new tokens about to run (the batch carries them to the device table)."""
        self.req_to_token.write(req.row, start, slots, mirror=False)

    def slots_of(self, req: Req, end: int) -> torch.Tensor:
        return self.req_to_token.read(req.row, end)

    def publish(self, req: Req, end: int) -> None:
        """A prompt's tokens up to `end`, scheduled for this step, go into the cache before it runs:
        a request admitted after it in the same step (a burst sharing a system prompt, forks, n > 1)
        reads their K/V instead of computing them again or waiting a step for them. That is sound
        because a step writes every row's K/V of a layer before any row attends (AttentionBackend.forward),
        no release happens while a step runs, and a step that fails empties the cache
        (Scheduler.fail_all). Where the cache already holds another copy of the next token (an
        identical prompt matched short of its last token) nothing is published: cache_unfinished
        settles it after the step, as before."""
        if self.cache.disable:
            return
        tokens = req.prefix(end)
        if req.last_node.children.get(tokens[req.cached_len]) is not None:
            return
        prefix_len, node = self.cache.insert_node(tokens, self.slots_of(req, end), req.last_node, req.cached_len)
        assert prefix_len == req.cached_len, (prefix_len, req.cached_len)
        self.cache.inc_lock(node)
        self.cache.dec_lock(req.last_node)
        req.last_node, req.cached_len = node, end

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill: hand the prompt's KV to the cache so waiting requests can share it."""
        if self.cache.disable or req.cached_len == req.kv_len:  # published when it was scheduled
            return
        tokens = req.prefix(req.kv_len)
        slots = self.slots_of(req, req.kv_len).clone()
        prefix_len, node = self.cache.insert_node(tokens, slots, req.last_node, req.cached_len)
        if prefix_len == req.cached_len < len(tokens):
            # nobody cached any of our tokens meanwhile: the new leaf ends at our last token and our
            # row already holds the tree's slots (no second walk, no row rewrite: O(new tokens))
            self.cache.inc_lock(node)
            self.cache.dec_lock(req.last_node)
            req.last_node, req.cached_len = node, len(tokens)
            return
        self.allocator.free(slots[req.cached_len : prefix_len])  # our copies of tokens already cached
        match = self.cache.match_prefix(tokens, record_stats=False)
        self.cache.inc_lock(match.last_node)
        self.cache.dec_lock(req.last_node)
        self.req_to_token.write(req.row, 0, match.slots)
        req.last_node, req.cached_len = match.last_node, len(match.slots)

    def release(self, req: Req, cache: bool) -> None:
        """Frees the request's row; its KV goes into the radix cache (cache=True) or is freed."""
        if req.row is None:
            return
        slots = self.slots_of(req, req.kv_len).clone()
        if cache:
            # from the request's locked node: what it added is compared, not the prefix it was served
            prefix_len = self.cache.insert(req.prefix(req.kv_len), slots, req.last_node, req.cached_len)
            self.allocator.free(slots[req.cached_len : prefix_len])
        else:
            self.allocator.free(slots[req.cached_len :])
        self.cache.dec_lock(req.last_node)
        self.req_to_token.free(req.row)
        req.row, req.kv_len, req.cached_len, req.last_node = None, 0, 0, None

    def reclaim_unowned(self) -> int:
        """With no request holding KV (after every one was released on an internal error): frees the
        slots that are neither free nor cached, those of steps launched and never resolved. Returns
        how many there were."""
        owned = self.allocator.free_mask()
        for node in self.cache.iter_nodes():
            owned[node.value.to(torch.int64).cpu()] = True
        lost = (~owned).nonzero().flatten()
        self.allocator.free(lost)
        return int(lost.numel())

    def check_idle(self) -> str:
        """With nothing running, every slot is free or the cache's and no node is locked, and the
        radix tree is sound: "ok", or what is broken."""
        free, cached, total = self.allocator.num_free, self.cache.total_size, self.allocator.num_slots
        if free + cached != total:
            return f"{total - free - cached} KV slots neither free nor cached while idle (free {free}, cached {cached})"
        if self.cache.protected_size:
            return f"{self.cache.protected_size} cached tokens still locked while idle"
        try:
            self.cache.check_integrity()
        except AssertionError as e:
            return str(e)
        return "ok"
