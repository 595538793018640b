"""Which replica serves a request: prefix-aware routing with a load-balance fallback, and the
round-robin baseline. Pure Python (no Ray), so it is tested on its own.

Prefix policy, per request (`PrefixRouter.choose`):
  1. Among the replicas that are up, find the one whose tree (what this ingress sent it) shares the
     longest prefix with the request's routing key; ties go to the less loaded, then the lower index.
  2. The match counts only if it covers at least `min_match_fraction` of the key: a shared chat
     header or a short system prompt is not worth piling every request onto one replica.
  3. Imbalance threshold: affinity holds unless the chosen replica has more than `imbalance_abs`
     requests in flight beyond the least-loaded replica AND more than `imbalance_rel` times its
     load. Past that, the least-loaded replica gets the request (reason "balance"): recomputing a
     prefix costs one prefill, a queue that keeps growing costs every request behind it.
  4. No counting match (a new prefix): the least-loaded replica, ties to the one holding the least
     text (so new prefixes spread over the replicas' caches), then rotating.
The chosen replica's tree records the key, so the next request with that prefix follows it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixlm.server.scaleout.prefix_tree import PrefixTree

ROUTERS = ("prefix", "round-robin")
REASONS = ("prefix", "new", "balance", "no_key", "round_robin")


@dataclass(slots=True)
class RouterConfig:
    imbalance_abs: int = 8  # extra in-flight requests tolerated on the best-matching replica ...
    imbalance_rel: float = 2.0  # ... and the multiple of the least-loaded replica's load (both must be exceeded)
    min_match_fraction: float = 0.25  # a match shorter than this share of the key is treated as no match
    max_tree_chars: int = 4_000_000  # per replica; least recently used text is forgotten first

    def __post_init__(self) -> None:
        if self.imbalance_abs < 0:
            raise ValueError(f"imbalance_abs must be >= 0, got {self.imbalance_abs}")
        if self.imbalance_rel < 1.0:
            raise ValueError(f"imbalance_rel must be >= 1, got {self.imbalance_rel}")
        if not 0.0 <= self.min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction must be in [0, 1], got {self.min_match_fraction}")


@dataclass(frozen=True, slots=True)
class Decision:
    replica: int
    reason: str  # one of REASONS
    matched_chars: int = 0


class NoReplicaUp(RuntimeError):
    pass


class RoundRobinRouter:
    """The baseline: replicas that are up, in turn."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self._next = 0

    def choose(self, key: str | None, loads: Sequence[int], up: Sequence[bool]) -> Decision:
        for _ in range(self.num_replicas):
            i, self._next = self._next, (self._next + 1) % self.num_replicas
            if up[i]:
                return Decision(i, "round_robin")
        raise NoReplicaUp("no replica is up")

    def forget(self, replica: int) -> None:
        pass

    def tree_chars(self, replica: int) -> int:
        return 0


class PrefixRouter:
    """Prefix-aware routing (module docstring): one PrefixTree per replica."""

    def __init__(self, num_replicas: int, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.trees = [PrefixTree(self.config.max_tree_chars) for _ in range(num_replicas)]
        self._rotate = 0

    def choose(self, key: str | None, loads: Sequence[int], up: Sequence[bool]) -> Decision:
        live = [i for i in range(len(self.trees)) if up[i]]
        if not live:
            raise NoReplicaUp("no replica is up")
        least = self._least_loaded(live, loads)
        if key is None:
            return Decision(least, "no_key")
        matches = {i: self.trees[i].match(key) for i in live}
        best = max(live, key=lambda i: (matches[i], -loads[i], -i))
        cfg = self.config
        if matches[best] > 0 and matches[best] >= cfg.min_match_fraction * len(key):
            low = loads[least]
            overloaded = loads[best] - low > cfg.imbalance_abs and loads[best] > cfg.imbalance_rel * low
            decision = Decision(least, "balance", matches[least]) if overloaded else \
                Decision(best, "prefix", matches[best])
        else:
            decision = Decision(least, "new", matches[least])
        self.trees[decision.replica].insert(key)
        return decision

    def _least_loaded(self, live: list[int], loads: Sequence[int]) -> int:
        self._rotate += 1  # rotating among equals keeps ties from always landing on replica 0
        n = len(self.trees)
        return min(live, key=lambda i: (loads[i], self.trees[i].size, (i - self._rotate) % n))

    def forget(self, replica: int) -> None:
        """The replica restarted or went down: its cache is empty, so is our record of it."""
        self.trees[replica].clear()

    def tree_chars(self, replica: int) -> int:
        return self.trees[replica].size


def make_router(kind: str, num_replicas: int, config: RouterConfig | None = None) -> PrefixRouter | RoundRobinRouter:
    if kind == "prefix":
        return PrefixRouter(num_replicas, config)
    if kind == "round-robin":
        return RoundRobinRouter(num_replicas)
    raise ValueError(f"router must be one of {ROUTERS}, got {kind!r}")


# ----------------------------------------------------------------------- routing keys
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})


def _ids_key(ids: list) -> str:
    # a prefix of the id list gives a prefix of the string: every id ends with its separator
    return "ids:" + "".join(f"{int(t)}," for t in ids)


def _prompt_key(prompt: Any) -> str | None:
    """str | list[str] | list[int] | list[list[int]] (a batch is routed by its first prompt)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int) and not isinstance(first, bool):
            return _ids_key(prompt)
        if isinstance(first, list) and all(isinstance(t, int) for t in first):
            return _ids_key(first)
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only the text parts shape the prompt prefix
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _messages_key(body: dict) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    # tools are rendered ahead of the conversation by chat templates, so they lead the key too
    tools = body.get("tools")
    head = json.dumps(tools, sort_keys=True, separators=(",", ":")) + "\x1e" if tools else ""
    parts = [f"{m.get('role', '')}\x1f{_content_text(m.get('content'))}\x1e" for m in messages if isinstance(m, dict)]
    return head + "".join(parts)


def routing_key(path: str, body: Any) -> str | None:
    """The text whose prefix decides the replica: the prompt, the conversation, or the token ids.
    None when the request carries none we understand (it is routed by load; the replica's server
    validates it as usual)."""
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return None
    if path == "/v1/chat/completions":
        return _messages_key(body)
    if path == "/v1/completions":
        return _prompt_key(body.get("prompt"))
    key = _prompt_key(body.get("text"))
    return key if key is not None else _prompt_key(body.get("input_ids"))
