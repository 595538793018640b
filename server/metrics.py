"""Prometheus metrics (GET /metrics), one registry per app so several servers can share a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixlm.server.messages import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("radixlm_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.ttft = Histogram("radixlm_time_to_first_token_seconds", "Time to first token (streamed requests)",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixlm_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("radixlm_e2e_request_latency_seconds", "Submit to finish, per generation",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("radixlm_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter("radixlm_cached_prompt_tokens", "Prompt tokens served from the radix cache",
                                     registry=r)
        self.generation_tokens = Counter("radixlm_generation_tokens", "Generated tokens", registry=r)
        self.in_flight = Gauge("radixlm_in_flight_requests", "Generations submitted and not finished", registry=r)
        self.running = Gauge("radixlm_num_running_requests", "Requests holding KV in the scheduler", registry=r)
        self.waiting = Gauge("radixlm_num_waiting_requests", "Requests queued in the scheduler", registry=r)
        self.kv_used = Gauge("radixlm_kv_slots_used", "KV slots in use (running requests + cached)", registry=r)
        self.kv_total = Gauge("radixlm_kv_slots_total", "KV pool size in tokens", registry=r)
        self.hit_rate = Gauge("radixlm_cache_hit_rate", "Radix cache hit tokens / queried tokens (cumulative)",
                              registry=r)

    def update_scheduler(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_used.set(s.used_slots)
        self.kv_total.set(s.total_slots)
        self.hit_rate.set(s.hit_tokens / s.query_tokens if s.query_tokens else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
