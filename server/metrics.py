"""Prometheus metrics (GET /metrics), one registry per app so several servers can share a process.

Every series carries a `model_name` label; request metrics are recorded for every generation,
streamed or not (the scheduler reports each request's first token). docs/metrics.md maps
each name to its SGLang and vLLM counterpart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixlm.runtime.request.req import SchedulerStats
from radixlm.server.live_series import LiveSeries

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
M = ["model_name"]


class Metrics:
    def __init__(self, model_name: str = "default") -> None:
        self.model_name = model_name
        r = self.registry = CollectorRegistry()

        def labelled(kind, name: str, doc: str, labels=(), **kw):
            """The metric; with no labels beyond model_name, its child for this model."""
            metric = kind(name, doc, [*M, *labels], registry=r, **kw)
            return metric if labels else metric.labels(model_name)

        self._requests = labelled(Counter, "radixlm_requests", "HTTP requests by route and status", ("route", "status"))
        self._finished = labelled(Counter, "radixlm_request_finished", "Finished generations by finish reason",
                                  ("finish_reason",))
        h = {"buckets": _LATENCY_BUCKETS}
        self.ttft = labelled(Histogram, "radixlm_time_to_first_token_seconds", "Submit to first token", **h)
        self.itl = labelled(Histogram, "radixlm_inter_token_latency_seconds", "Time between output tokens",
                            buckets=_ITL_BUCKETS)
        self.e2e = labelled(Histogram, "radixlm_e2e_request_latency_seconds", "Submit to finish", **h)
        self.queue = labelled(Histogram, "radixlm_queue_time_seconds", "Waiting queue to first prefill", **h)
        self.prompt_tokens = labelled(Counter, "radixlm_prompt_tokens", "Prompt tokens of finished generations")
        self.cached_tokens = labelled(Counter, "radixlm_cached_prompt_tokens", "Prompt tokens from the radix cache")
        self.generation_tokens = labelled(Counter, "radixlm_generation_tokens", "Generated tokens")
        self.retractions = labelled(Counter, "radixlm_retractions", "Requests retracted when the KV pool ran dry")
        self.in_flight = labelled(Gauge, "radixlm_in_flight_requests", "Generations submitted and not finished")
        self.running = labelled(Gauge, "radixlm_num_running_requests", "Requests holding KV in the scheduler")
        self.waiting = labelled(Gauge, "radixlm_num_waiting_requests", "Requests queued in the scheduler")
        self.kv_used = labelled(Gauge, "radixlm_kv_slots_used", "KV slots held by running requests")
        self.kv_cached = labelled(Gauge, "radixlm_kv_slots_cached", "KV slots held only by the radix cache")
        self.kv_total = labelled(Gauge, "radixlm_kv_slots_total", "KV pool size in tokens")
        self.kv_usage = labelled(Gauge, "radixlm_kv_usage_ratio", "Running requests' KV slots / pool size (0-1)")
        self.hit_rate = labelled(Gauge, "radixlm_cache_hit_rate", "Radix cache hit tokens / queried tokens")
        self.restarts = labelled(Counter, "radixlm_scheduler_restarts", "Scheduler/detokenizer restarts after a death")
        self._retractions_seen = 0
        self.series = LiveSeries()  # the last minutes, for GET /cache and the cache page

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.series.first_token(seconds)

    def request(self, route: str, status: int) -> None:
        self._requests.labels(self.model_name, route, str(status)).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def update_scheduler(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_used.set(s.used_slots)
        self.kv_cached.set(s.cached_slots)
        self.kv_total.set(s.total_slots)
        self.kv_usage.set(s.used_slots / s.total_slots if s.total_slots else 0.0)
        self.hit_rate.set(s.hit_tokens / s.query_tokens if s.query_tokens else 0.0)
        self.series.load(s.num_running, s.num_waiting, s.hit_tokens, s.query_tokens)
        if s.retractions > self._retractions_seen:  # a cumulative count from the scheduler
            self.retractions.inc(s.retractions - self._retractions_seen)
            self._retractions_seen = s.retractions

    def render(self) -> bytes:
        return generate_latest(self.registry)
