"""An approximate record of the prompts one replica has seen: a character radix tree with a size
budget and least-recently-used eviction.

The ingress keeps one tree per replica. It never holds KV, only the text it sent, so it may be
wrong in both directions (the replica may have evicted what the tree still holds, and the tree
may have evicted what the replica still caches); it only has to rank replicas well. What it
guarantees, and tests check: `match` never claims more than the longest common prefix with a key
inserted and not evicted, `size` never exceeds the budget after an insert, and eviction takes the
least recently inserted text first.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class _Node:
    label: str  # the characters on the edge from the parent to this node
    parent: _Node | None
    children: dict[str, _Node] = field(default_factory=dict)  # keyed by the child label's first char
    last_use: int = 0  # logical clock of the last insert or match through this node


def _common_length(a: str, b: str, start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]` (binary search over C-speed slice
    compares, so a long edge costs O(log n) Python steps, not one per character)."""
    lo, hi = 0, min(len(a), len(b) - start)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid], start):
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """Text prefixes sent to one replica. `insert(key)` records a prompt, `match(key)` returns how
    many leading characters of `key` some recorded prompt shares, `size` counts stored characters.
    Eviction cost is a walk over the tree's nodes (a few per prompt), paid only once it is full."""

    def __init__(self, max_chars: int = 4_000_000):
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.size = 0
        self._root = _Node("", None)
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def match(self, key: str) -> int:
        """The length of the longest prefix of `key` stored in the tree (read-only: only `insert`
        counts as a use for eviction, and the router inserts every key it routes)."""
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            if key.startswith(child.label, pos):
                node, pos = child, pos + len(child.label)
                continue
            return pos + _common_length(child.label, key, pos)
        return pos

    def insert(self, key: str) -> None:
        """Records `key` (its first `max_chars` characters), marks its path as the most recently
        used and evicts old text if the tree outgrew its budget. Splits an edge where `key`
        leaves it midway."""
        key = key[: self.max_chars]
        now = self._tick()
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:  # the rest of the key is new: one leaf
                leaf = _Node(key[pos:], node, last_use=now)
                node.children[key[pos]] = leaf
                self.size += len(leaf.label)
                break
            n = _common_length(child.label, key, pos)
            if n < len(child.label):  # split: node -> mid (shared part, used now) -> child (the rest, as old as it was)
                mid = _Node(child.label[:n], node, last_use=now)
                node.children[key[pos]] = mid
                child.label, child.parent = child.label[n:], mid
                mid.children[child.label[0]] = child
                child = mid
            child.last_use = now
            node, pos = child, pos + n
        if self.size > self.max_chars:
            self._evict(self.size - self.max_chars)

    def _evict(self, chars: int) -> None:
        """Removes least recently used leaves until at least `chars` characters are gone; a parent
        left without children becomes a leaf and may go next."""
        leaves = [(n.last_use, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        freed = 0
        while freed < chars and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent  # never None: the root is not in the heap
            del parent.children[leaf.label[0]]
            freed += len(leaf.label)
            self.size -= len(leaf.label)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_use, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def keys(self) -> list[str]:
        """Every stored root-to-leaf string (for tests and debugging)."""
        out: list[str] = []
        stack = [(c, c.label) for c in self._root.children.values()]
        while stack:
            n, text = stack.pop()
            if not n.children:
                out.append(text)
            stack.extend((c, text + c.label) for c in n.children.values())
        return out

    def clear(self) -> None:
        self._root = _Node("", None)
        self.size = 0
