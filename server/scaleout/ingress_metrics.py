"""The ingress's Prometheus metrics: router decisions as they happen, per-replica state (up, load,
restarts, cache hit rate from the replica's own server) refreshed at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from radixlm.server.scaleout.router import REASONS


class IngressMetrics:
    def __init__(self, num_replicas: int) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("radixlm_router_decisions", "Requests routed, by replica and reason "
                                 "(prefix, new, balance, no_key, round_robin)", ["replica", "reason"], registry=r)
        self.matched_chars = Counter("radixlm_router_matched_chars", "Routing-key characters the chosen replica "
                                     "had been sent before", ["replica"], registry=r)
        self.key_chars = Counter("radixlm_router_key_chars", "Routing-key characters routed", ["replica"], registry=r)
        self.replica_errors = Counter("radixlm_replica_errors", "Requests that failed because the replica died "
                                      "or stopped answering", ["replica"], registry=r)
        self.restarts = Counter("radixlm_replica_restarts", "Times a replica came back as a new instance",
                                ["replica"], registry=r)
        self.up = Gauge("radixlm_replica_up", "1 if the replica is taking requests", ["replica"], registry=r)
        self.in_flight = Gauge("radixlm_replica_in_flight_requests", "Requests the ingress has in flight on the "
                               "replica (the router's load figure)", ["replica"], registry=r)
        self.tree_chars = Gauge("radixlm_router_tree_chars", "Characters the router remembers sending to the "
                                "replica", ["replica"], registry=r)
        self.hit_rate = Gauge("radixlm_replica_cache_hit_rate", "Cached prompt tokens / prompt tokens of the "
                              "replica's finished requests (NaN before any)", ["replica"], registry=r)
        self.replica_stats = Gauge("radixlm_replica_stat", "Figures read from the replica's own /metrics",
                                   ["replica", "name"], registry=r)
        self.num_replicas = num_replicas
        for i in range(num_replicas):  # every series exists from the start, so rates work from zero
            label = str(i)
            for reason in REASONS:
                self.decisions.labels(label, reason)
            for counter in (self.matched_chars, self.key_chars, self.replica_errors, self.restarts):
                counter.labels(label)

    def decision(self, replica: int, reason: str, matched: int, key_chars: int) -> None:
        label = str(replica)
        self.decisions.labels(label, reason).inc()
        self.matched_chars.labels(label).inc(matched)
        self.key_chars.labels(label).inc(key_chars)

    def render(self, up: list[bool], loads: list[int], tree_chars: list[int], stats: list[dict]) -> bytes:
        for i in range(self.num_replicas):
            label = str(i)
            self.up.labels(label).set(1.0 if up[i] else 0.0)
            self.in_flight.labels(label).set(loads[i])
            self.tree_chars.labels(label).set(tree_chars[i])
            prompt, cached = stats[i].get("prompt_tokens"), stats[i].get("cached_tokens")
            self.hit_rate.labels(label).set(cached / prompt if prompt else float("nan"))
            for name, value in stats[i].items():
                self.replica_stats.labels(label, name).set(value)
        return generate_latest(self.registry)
