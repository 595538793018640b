"""Nodes of the radix tree and small helpers shared by the cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class TreeNode:
    """One edge of the radix tree plus the node it leads to.

    ``key`` is the edge label (token ids, a tuple), ``value`` the int64 KV slot of each of those
    tokens, ``lock_ref`` the number of locks held on this node or any descendant, and
    ``last_access`` a logical clock value (larger = used more recently). ``node_id`` is unique per
    cache and only breaks ties deterministically. For people (GET /cache) and snapshots: ``hits``
    counts admitted requests whose cached prefix ran through this node (so a parent never has fewer
    than its children), ``last_used`` is the wall-clock time (time.time()) of the last access.
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "node_id", "hits", "last_used")

    def __init__(
        self,
        key: tuple[int, ...],
        value: torch.Tensor,
        parent: TreeNode | None,
        node_id: int,
        last_access: int = 0,
    ) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = node_id
        self.hits = 0
        self.last_used = 0.0

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.node_id}, key={self.key!r}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, hits={self.hits}, children={len(self.children)})"
        )


class MatchResult(NamedTuple):
    slots: torch.Tensor  # int64 1-D: KV slot of each matched token (empty if nothing matched)
    last_node: TreeNode  # deepest node of the match; the root if nothing matched


def common_prefix_len(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[start:]``."""
    n = min(len(key), len(tokens) - start)
    if tokens[start : start + n] == key[:n]:
        return n
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i


def path_tokens(node: TreeNode) -> tuple[int, ...]:
    """The token prefix the root-to-``node`` path spells."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def as_token_tuple(tokens: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    if isinstance(tokens, torch.Tensor):
        return tuple(tokens.tolist())
    return tuple(tokens)
