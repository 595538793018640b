"""One replica: a Ray Serve deployment that runs one ordinary RadixLM server on a loopback port of
its own machine and forwards the requests the ingress hands it.

Reusing the whole server (rather than an Engine and a copy of its routes) keeps every route, limit
and error of a single server identical behind the ingress. Only plain values cross Ray: the
ingress sends (method, path, query, headers, body bytes); `forward` yields a head
`{"status", "headers"}`, then body chunks as bytes, and ends with `{"error": message}` instead if
the server stops answering midway. Every socket this opens is on 127.0.0.1; replicas on other
machines are reached through Ray's own transport.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx

logger = logging.getLogger("radixlm.server.scaleout")

# response headers worth passing back; hop-by-hop and length headers are the ingress's to set
PASS_HEADERS = frozenset({"content-type", "cache-control", "x-accel-buffering", "www-authenticate", "retry-after"})
SHUTDOWN_TIMEOUT_S = 30


def parse_server_metrics(text: str) -> dict[str, float]:
    """The numbers the ingress reports per replica, from the server's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"radixlm_prompt_tokens": "prompt_tokens", "radixlm_cached_prompt_tokens": "cached_tokens",
              "radixlm_generation_tokens": "generation_tokens", "radixlm_num_running_requests": "running",
              "radixlm_num_waiting_requests": "waiting", "radixlm_cache_hit_rate": "radix_hit_rate",
              "radixlm_kv_slots_used": "kv_slots_used", "radixlm_kv_slots_total": "kv_slots_total",
              "radixlm_in_flight_requests": "in_flight"}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = wanted.get(family.name)
        if name is None:
            continue
        for sample in family.samples:
            if sample.name in (family.name, family.name + "_total"):
                out[name] = float(sample.value)
    return out


class ReplicaServer:
    """The replica deployment's class (wrapped with `serve.deployment` by the launcher)."""

    def __init__(self, index: int, server_kwargs: dict[str, Any], env: dict[str, str] | None = None):
        os.environ.update(env or {})  # e.g. OMP_NUM_THREADS: read by the server's children at start
        from radixlm.server import launch_server

        self.index = index
        self.instance = uuid.uuid4().hex  # a restarted replica has a new one: the ingress forgets the old tree
        self.server = launch_server(**{**server_kwargs, "host": "127.0.0.1", "port": 0})
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=httpx.Timeout(None, connect=30),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        logger.info("replica %d: RadixLM server at %s (pid %d)", index, self.server.url, os.getpid())

    def _dead(self) -> str | None:
        if self.server.process.is_alive():
            return None
        return f"replica {self.index}: its RadixLM server exited (exit code {self.server.process.exitcode})"

    async def forward(self, method: str, path: str, query: str, headers: dict[str, str],
                      body: bytes) -> AsyncIterator[dict | bytes]:
        url = path + ("?" + query if query else "")
        request = self.client.build_request(method, url, headers=headers, content=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            yield {"error": self._dead() or f"replica {self.index}: its server did not answer ({type(e).__name__})"}
            return
        try:
            yield {"status": response.status_code,
                   "headers": {k: v for k, v in response.headers.items() if k.lower() in PASS_HEADERS}}
            async for chunk in response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as e:
            yield {"error": self._dead() or f"replica {self.index}: the response broke off ({type(e).__name__})"}
        finally:  # also on cancellation (the client left): closing the stream aborts the generation
            await response.aclose()

    async def ping(self) -> dict[str, Any]:
        return {"instance": self.instance, "pid": os.getpid(), "server_pid": self.server.process.pid,
                "alive": self._dead() is None}

    async def stats(self) -> dict[str, float]:
        headers = {"Authorization": f"Bearer {self.server.api_key}"} if self.server.api_key else {}
        response = await self.client.get("/metrics", headers=headers, timeout=10)
        response.raise_for_status()
        return parse_server_metrics(response.text)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes Serve replace the replica."""
        dead = self._dead()
        if dead:
            raise RuntimeError(dead)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
