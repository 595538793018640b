"""Radix tree over token-id sequences whose nodes own KV-cache slot indices.

Each edge of the tree is labelled with a run of token ids (``TreeNode.key``) and carries the KV slot
of every one of those tokens (``TreeNode.value``). The path from the root to a node spells a token
prefix; the concatenated values along it are the KV slots holding that prefix's keys and values.

Ownership: every slot stored in the tree is owned by the tree and goes back to the allocator
(``allocator.free``) when its node is evicted or the cache is reset. Running requests protect the
prefix they reuse with ``inc_lock``/``dec_lock``: a node with ``lock_ref > 0`` is never evicted.

Sizes are counted in tokens (= slots, page size 1): ``evictable_size`` covers unlocked nodes,
``protected_size`` locked ones.

For people and snapshots the cache also keeps per-node ``hits`` and ``last_used`` (set per node on
paths it walks anyway: no per-token work is added), hit rates over recent windows and evictions by
reason (``stats.py``); ``report.py`` summarises the tree from them.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from radixlm.radix_cache.stats import EvictionLog, HitWindows
from radixlm.radix_cache.tree import MatchResult, TreeNode, as_token_tuple, common_prefix_len


class SlotAllocator(Protocol):
    """What the cache needs from the KV pool's allocator: a way to give slots back."""

    def free(self, slots: torch.Tensor) -> None: ...


class RadixCache:
    """Prefix cache mapping token sequences to the KV slots that hold them.

    With ``disable=True`` the cache stores nothing: matches are always empty, inserted slots are
    freed at once, and all sizes stay 0 (the ablation baseline).
    """

    def __init__(
        self,
        allocator: SlotAllocator,
        disable: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        self.allocator = allocator
        self.disable = disable
        self.device = torch.device(device)
        self.hit_tokens = 0
        self.query_tokens = 0
        self.windows = HitWindows()
        self.evictions = EvictionLog()
        self._clock = 0
        self._next_id = 0
        # The root object outlives reset(): a request holding it as last_node stays valid.
        self.root = self._new_node((), self._empty(), None)
        self._clear()

    # ------------------------------------------------------------------ internals

    def _clear(self) -> None:
        self.root.children = {}
        self._evictable_size = 0
        self._protected_size = 0
        self._num_nodes = 0  # excluding the root

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _new_node(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        node = TreeNode(key, value, parent, self._next_id)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch_path(self, node: TreeNode, now: int) -> None:
        """Stamp ``node`` and all its ancestors with access time ``now`` (and the wall clock)."""
        wall = time.time()
        while node is not None:
            node.last_access = now
            node.last_used = wall
            node = node.parent

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Split ``child``'s edge after ``at`` tokens; return the new upper node.

        The upper node takes over ``child``'s place under its parent; ``child`` keeps the tail of
        the edge. Lock counts, hits and access times carry over (the upper node's only descendant
        is the old subtree), so sizes, LRU order and hit counts are unchanged.
        """
        parent = child.parent
        upper = self._new_node(child.key[:at], child.value[:at], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.last_used = child.last_used
        upper.hits = child.hits
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------------ public API

    def match_prefix(self, tokens: Sequence[int], record_stats: bool = True) -> MatchResult:
        """Find the longest cached prefix of ``tokens``.

        Returns the KV slots of the matched tokens and the deepest matched node. Side effects:
        if the match ends in the middle of an edge, that node is SPLIT in two so that
        ``last_node`` ends exactly at the match (the tree's content is unchanged, its shape is
        not); every node on the matched path gets a fresh access time (LRU). With
        ``record_stats`` the match is counted as a hit (``count_hit``).
        """
        tokens = as_token_tuple(tokens)
        if self.disable:
            if record_stats:
                self.count_hit(self.root, 0, len(tokens))
            return MatchResult(self._empty(), self.root)
        node = self.root
        pos = 0
        pieces: list[torch.Tensor] = []
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tokens, pos)
            partial = k < len(child.key)
            if partial:
                child = self._split(child, k)
            pieces.append(child.value)
            node = child
            pos += k
            if partial:
                break
        self._touch_path(node, self._tick())
        if record_stats:
            self.count_hit(node, pos, len(tokens))
        # torch.cat copies, so the caller never holds a view into the tree's own tensors.
        return MatchResult(torch.cat(pieces) if pieces else self._empty(), node)

    def insert(self, tokens: Sequence[int], slots: torch.Tensor, start_node: TreeNode | None = None,
               start: int = 0) -> int:
        return self.insert_node(tokens, slots, start_node, start)[0]

    def insert_node(self, tokens: Sequence[int], slots: torch.Tensor, start_node: TreeNode | None = None,
                    start: int = 0) -> tuple[int, TreeNode]:
        """``insert``, returning the node where the insertion ended too: a new leaf whose path is
        exactly ``tokens`` when ``prefix_len < len(tokens)``; otherwise the deepest node reached
        (its path may run past ``tokens``; disabled mode: the root).

        Cache ``tokens`` with their KV ``slots`` (one per token).

        Returns ``prefix_len``, the number of leading tokens that were already cached. The tree
        takes ownership of ``slots[prefix_len:]``; ``slots[:prefix_len]`` stay with the caller,
        who frees those that are not the tree's own (duplicates computed while another request
        inserted the same prefix). May split one node where the new tokens branch off an edge.
        Disabled mode frees all of ``slots`` through the allocator and returns 0.

        ``start_node``: a node the caller holds locked whose path spells ``tokens[:start]`` (a request's
        cached prefix): the walk begins there, so a finishing request compares only what it added.
        """
        tokens = as_token_tuple(tokens)
        slots = torch.as_tensor(slots)
        if slots.dim() != 1 or len(slots) != len(tokens):
            raise ValueError(
                f"insert needs one slot per token: got {len(tokens)} tokens and slots of shape "
                f"{tuple(slots.shape)}"
            )
        if self.disable:
            if len(slots):
                self.allocator.free(slots)
            return 0, self.root
        node = self.root if start_node is None else start_node
        pos = start if start_node is not None else 0
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                value = slots[pos:].to(dtype=torch.int64, copy=True)
                leaf = self._new_node(tokens[pos:], value, node)
                node.children[tokens[pos]] = leaf
                self._num_nodes += 1
                self._evictable_size += n - pos
                node = leaf
                prefix_len = pos
                break
            k = common_prefix_len(child.key, tokens, pos)
            if k < len(child.key) and pos + k < n:
                child = self._split(child, k)
            node = child
            pos += k
        else:
            prefix_len = n
        self._touch_path(node, self._tick())
        return prefix_len, node

    def count_hit(self, last_node: TreeNode, hit_tokens: int, query_tokens: int) -> None:
        """Counts one request served from the cache: ``hit_tokens`` of its ``query_tokens`` prompt
        tokens were cached, up to ``last_node``, whose path (ancestors too) gains a hit."""
        self.hit_tokens += hit_tokens
        self.query_tokens += query_tokens
        self.windows.add(hit_tokens, query_tokens)
        node = last_node
        while node is not None and node is not self.root:
            node.hits += 1
            node = node.parent

    def inc_lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors (not the root) from eviction."""
        if not self.is_attached(node):
            raise RuntimeError(f"inc_lock on a node that is no longer in the tree: {node!r}")
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: TreeNode) -> None:
        """Release one lock taken with ``inc_lock(node)``; RuntimeError if none is held."""
        if node is not self.root and node.lock_ref <= 0:
            raise RuntimeError(f"dec_lock would take lock_ref below 0: {node!r}")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_size -= len(node.key)
                self._evictable_size += len(node.key)
            node = node.parent

    def is_attached(self, node: TreeNode) -> bool:
        """Whether ``node`` is still in the tree (eviction and reset detach nodes for good)."""
        while node is not self.root:
            parent = node.parent
            if parent is None or parent.children.get(node.key[0]) is not node:
                return False
            node = parent
        return True

    def evict(self, num_tokens: int, reason: str = "capacity") -> int:
        """Free at least ``num_tokens`` slots if that many are evictable; return how many were freed.

        Removes unlocked leaves, least recently used first; a parent whose last child goes
        becomes a leaf candidate in turn. Freed slots go back through ``allocator.free``; the
        eviction is logged under ``reason`` (``self.evictions``).
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._unlocked_leaves()]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            leaf.parent = None
            freed.append(leaf.value)
            num_freed += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            self._num_nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if freed:
            self.allocator.free(torch.cat(freed))
            self.evictions.record(reason, len(freed), num_freed)
        return num_freed

    def _unlocked_leaves(self) -> list[TreeNode]:
        leaves = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.children or child.lock_ref > 0:
                    stack.append(child)
                else:
                    leaves.append(child)
        return leaves

    def reset(self) -> None:
        """Drop every cached prefix, freeing all slots; RuntimeError if any node is locked.

        Hit/query counters are kept (see ``reset_stats``).
        """
        locked = [c for c in self.root.children.values() if c.lock_ref > 0]
        if locked:
            raise RuntimeError(f"cannot reset the radix cache: {len(locked)} locked subtree(s) in use")
        values = [node.value for node in self.iter_nodes()]
        self._clear()
        if values:
            freed = torch.cat(values)
            self.allocator.free(freed)
            self.evictions.record("flush", len(values), len(freed))

    def iter_nodes(self) -> Iterator[TreeNode]:
        """All nodes except the root (depth first)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ sizes and stats

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def reset_stats(self) -> None:
        self.hit_tokens = 0
        self.query_tokens = 0
        self.windows.clear()

    def stats(self) -> dict:
        return {
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "evictable_size": self._evictable_size,
            "protected_size": self._protected_size,
            "num_nodes": self._num_nodes,
        }

    def check_integrity(self) -> None:
        """Recount everything and raise AssertionError naming the first broken invariant."""

        def fail(msg: str) -> None:
            raise AssertionError(f"radix cache integrity: {msg}")

        root = self.root
        if root.parent is not None or root.key != () or len(root.value) != 0:
            fail("root must have no parent, an empty key and no slots")
        if self.disable and root.children:
            fail("disabled cache holds nodes")
        evictable = protected = num_nodes = 0
        seen: set[int] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for first, child in node.children.items():
                if child.parent is not node:
                    fail(f"{child!r} does not point back to its parent")
                if not child.key:
                    fail(f"{child!r} has an empty edge")
                if child.key[0] != first:
                    fail(f"{child!r} is keyed by {first}, not by its first token")
                if child.lock_ref < 0:
                    fail(f"{child!r} has a negative lock_ref")
                if child.last_access > node.last_access and node is not root:
                    fail(f"{child!r} was used more recently than its parent {node!r}")
                if child.hits > node.hits and node is not root:
                    fail(f"{child!r} has more hits than its parent {node!r}")
                value = child.value
                if value.dtype != torch.int64 or value.dim() != 1 or len(value) != len(child.key):
                    fail(f"{child!r} has slots {value!r} that do not fit its key")
                slots = value.tolist()
                if seen.intersection(slots) or len(set(slots)) != len(slots):
                    fail(f"{child!r} holds a slot that is owned twice")
                seen.update(slots)
                child_locks += child.lock_ref
                num_nodes += 1
                if child.lock_ref > 0:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                stack.append(child)
            if node is not root and node.lock_ref < child_locks:
                fail(f"{node!r} has lock_ref below the sum of its children's ({child_locks})")
        if evictable != self._evictable_size:
            fail(f"evictable_size is {self._evictable_size}, recount gives {evictable}")
        if protected != self._protected_size:
            fail(f"protected_size is {self._protected_size}, recount gives {protected}")
        if num_nodes != self._num_nodes:
            fail(f"num_nodes is {self._num_nodes}, recount gives {num_nodes}")
