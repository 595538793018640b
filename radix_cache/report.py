"""The radix tree summarised for people (GET /cache, GET /cache/tree) and the hottest-first choice of
nodes a snapshot keeps.

Everything here runs on the thread that owns the cache, so it is bounded: a walk visits at most
MAX_VISIT nodes and, where it is cut short, says so (`truncated`); what it returns is bounded by its
arguments. Walks go hottest first (hits, then recency), so a cut drops the coldest part of the tree.
Token ids come back as ids (`head_ids`): the caller decodes them, off the scheduler thread.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from radixlm.radix_cache.radix_cache import RadixCache
from radixlm.radix_cache.tree import TreeNode, path_tokens

MAX_VISIT = 20_000  # nodes one walk may consider (tens of ms of Python on a slow, busy CPU)
HEAD_TOKENS = 48  # ids of a prefix (or of an edge) returned for display
TAIL_TOKENS = 24  # and of a prefix's end, where prefixes sharing a system prompt differ


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic GC off for one walk: the walk builds tens of thousands of tuples holding
    nodes, and each 700 of them would set off a collection over the whole (large) tree, making the
    walk several times slower."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Walk:
    """The hottest part of the tree, at most `limit` nodes, parents before children, as parallel
    lists (index i: node, its depth, its prefix length, its parent's index or -1 for the root's
    children); `truncated` when nodes were left unvisited. At most `limit` nodes are ever put on
    the walk's heap (a node with more children than there is room for offers its hottest ones), so
    the work is bounded whatever the tree's size or fan-out."""

    def __init__(self, cache: RadixCache, limit: int) -> None:
        self.nodes: list[TreeNode] = []
        self.depth: list[int] = []
        self.end: list[int] = []
        self.parent: list[int] = []
        self.truncated = False
        self._room = limit
        # a parent never has fewer hits nor an older access than its children, so this order
        # visits parents first: a cut keeps a connected, hottest part of the tree
        heap: list = []
        self._push(heap, cache.root, -1, 0, 0)
        with _no_gc():
            self._run(heap, limit)

    def _run(self, heap: list, limit: int) -> None:
        while heap and len(self.nodes) < limit:
            _, _, _, node, parent, depth, start = heapq.heappop(heap)
            i = len(self.nodes)
            end = start + len(node.key)
            self.nodes.append(node)
            self.depth.append(depth)
            self.end.append(end)
            self.parent.append(parent)
            self._push(heap, node, i, depth, end)
        self.truncated = self.truncated or bool(heap)

    def _push(self, heap: list, node: TreeNode, index: int, depth: int, end: int) -> None:
        children = node.children.values()
        if len(children) > self._room:
            children = heapq.nlargest(self._room, children, key=lambda c: (c.hits, c.last_access))
            self.truncated = True
        self._room -= len(children)
        for c in children:
            heapq.heappush(heap, (-c.hits, -c.last_access, c.node_id, c, index, depth + 1, end))


def _node_info(node: TreeNode, depth: int, prefix_len: int) -> dict:
    return {"id": node.node_id, "depth": depth, "edge_tokens": len(node.key), "prefix_tokens": prefix_len,
            "hits": node.hits, "last_used": node.last_used, "locked": node.lock_ref > 0,
            "children": len(node.children)}


def summary(cache: RadixCache, top: int = 10, head_tokens: int = HEAD_TOKENS, limit: int = MAX_VISIT) -> dict:
    """Sizes, the `top` prefixes by tokens saved, hit rates over windows and evictions by reason.

    A prefix's tokens saved = its hits x its length: what the requests that reused the whole
    prefix did not have to prefill again. Only prefixes that saved something are listed, each with
    the ids of its head and (past the head) of its tail."""
    walk = _Walk(cache, limit)
    saved = [n.hits * e for n, e in zip(walk.nodes, walk.end)]
    best = heapq.nlargest(top, (i for i in range(len(saved)) if saved[i]),
                          key=lambda i: (saved[i], -walk.nodes[i].node_id))
    prefixes = []
    for i in best:
        node = walk.nodes[i]
        info = _node_info(node, walk.depth[i], walk.end[i])
        path = path_tokens(node)
        info.update(tokens_saved=saved[i], head_ids=list(path[:head_tokens]),
                    tail_ids=list(path[max(head_tokens, len(path) - TAIL_TOKENS):]))
        prefixes.append(info)
    return {
        "cached_tokens": cache.total_size,
        "locked_tokens": cache.protected_size,
        "evictable_tokens": cache.evictable_size,
        "nodes": cache.num_nodes,
        "truncated": walk.truncated,
        "hit_rate": {"all": {"hit_tokens": cache.hit_tokens, "query_tokens": cache.query_tokens,
                             "hit_rate": cache.hit_tokens / cache.query_tokens if cache.query_tokens else None},
                     **cache.windows.rates()},
        "top_prefixes": prefixes,
        "evictions": cache.evictions.to_dict(),
    }


def tree(cache: RadixCache, depth: int = 8, min_tokens: int = 0, max_nodes: int = 500,
         head_tokens: int = HEAD_TOKENS, limit: int = MAX_VISIT) -> dict:
    """The tree's structure down to `depth` edges, leaving out subtrees of fewer than `min_tokens`
    cached tokens, at most `max_nodes` nodes (largest subtrees first). Each node lists its parent's
    id (the root's is `root`), sizes, hits, last use, lock state and the ids of its edge's head;
    `hidden_children` / `hidden_tokens` count what was left out right below it (`root_hidden_*`
    below the root). Subtree sizes count the nodes the walk visited (all unless `truncated`)."""
    walk = _Walk(cache, limit)
    n = len(walk.nodes)
    sub = [len(node.key) for node in walk.nodes]
    kids: list[list[int]] = [[] for _ in range(n)]
    top: list[int] = []
    for i in range(n - 1, -1, -1):  # children come after their parent: sizes add up bottom-up
        p = walk.parent[i]
        if p >= 0:
            sub[p] += sub[i]
            kids[p].append(i)
        else:
            top.append(i)
    hidden = [[0, 0] for _ in range(n + 1)]  # index n: the root
    heap: list[tuple[int, int, int]] = []

    def offer(i: int, parent: int) -> None:
        if walk.depth[i] <= depth and sub[i] >= min_tokens:
            heapq.heappush(heap, (-sub[i], walk.nodes[i].node_id, i))
        else:
            hidden[parent][0] += 1
            hidden[parent][1] += sub[i]

    for i in top:
        offer(i, n)
    shown: list[int] = []
    while heap:
        _, _, i = heapq.heappop(heap)
        p = walk.parent[i] if walk.parent[i] >= 0 else n
        if len(shown) >= max_nodes:
            hidden[p][0] += 1
            hidden[p][1] += sub[i]
            continue
        shown.append(i)
        for k in kids[i]:
            offer(k, i)
    nodes = []
    for i in shown:
        node = walk.nodes[i]
        info = _node_info(node, walk.depth[i], walk.end[i])
        info.update(parent=node.parent.node_id, subtree_tokens=sub[i], head_ids=list(node.key[:head_tokens]),
                    hidden_children=hidden[i][0], hidden_tokens=hidden[i][1])
        nodes.append(info)
    return {"root": cache.root.node_id, "cached_tokens": cache.total_size, "nodes_total": cache.num_nodes,
            "root_hidden_children": hidden[n][0], "root_hidden_tokens": hidden[n][1], "truncated": walk.truncated,
            "nodes": nodes}


@dataclass(slots=True)
class Kept:
    """One node a snapshot keeps: the first `take` tokens of its edge (all of them unless the
    budget ran out inside it), under the kept node at index `parent` (-1: the root)."""

    node: TreeNode
    parent: int
    take: int


def hottest(cache: RadixCache, max_tokens: int) -> list[Kept]:
    """The hottest part of the tree holding at most `max_tokens` tokens, parents before children.

    Best first by (hits, recency): parents come before their children in that order, so what is
    kept is always a connected part of the tree holding the root. The node where the budget runs
    out is kept in part (a prefix of an edge is a valid cache entry) and the walk ends there."""
    kept: list[Kept] = []
    heap = [(-c.hits, -c.last_access, c.node_id, c, -1) for c in cache.root.children.values()]
    heapq.heapify(heap)
    left = max_tokens
    with _no_gc():
        _take_hottest(heap, left, kept)
    return kept


def _take_hottest(heap: list, left: int, kept: list[Kept]) -> None:
    while heap and left > 0:
        *_, node, parent = heapq.heappop(heap)
        take = min(len(node.key), left)
        kept.append(Kept(node, parent, take))
        left -= take
        if take == len(node.key):
            i = len(kept) - 1
            for c in node.children.values():
                heapq.heappush(heap, (-c.hits, -c.last_access, c.node_id, c, i))
