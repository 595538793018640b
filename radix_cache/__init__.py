"""Radix-tree prefix cache: token-id sequences -> KV slots, LRU eviction, ref-count locks."""

from radixlm.radix_cache.radix_cache import RadixCache, SlotAllocator
from radixlm.radix_cache.tree import MatchResult, TreeNode

__all__ = ["MatchResult", "RadixCache", "SlotAllocator", "TreeNode"]
