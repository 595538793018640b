"""The ingress deployment: one port with every route of a RadixLM server, each request passed to
the replica the router picks, through that replica's Serve deployment handle (Ray's transport).

Handled here: `/health` (up if any replica is), `/metrics` (router decisions and per-replica
state, see ingress_metrics.py), `/flush_cache` (every replica, and the router forgets). Everything
else goes to one replica unchanged, so validation, errors and streaming are the server's own.

Failure handling: a replica that dies (its actor or its server) fails the requests it had with a
503 (or, once a stream has started, an SSE error event and [DONE]), is marked down and forgotten by
the router, and gets no new requests until a probe finds it answering again as a new instance
(Ray Serve restarts it: its `check_health` raises once the server has exited).
"""


import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixlm.server.scaleout.ingress_metrics import IngressMetrics
from radixlm.server.scaleout.router import GENERATION_PATHS, NoReplicaUp, RouterConfig, make_router, routing_key

logger = logging.getLogger("radixlm.server.scaleout")

FORWARD_HEADERS = frozenset({"authorization", "content-type", "accept", "x-request-id"})
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 10.0  # a ping to a replica that Ray is restarting waits for the new one; give up after this
STATS_TIMEOUT_S = 5.0
SSE_DONE = b"data: [DONE]\n\n"

app = FastAPI(title="RadixLM (scale-out)", docs_url=None, redoc_url=None, openapi_url=None)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    kind = {401: "authentication_error", 413: "invalid_request_error", 503: "service_unavailable_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


class _ReplicaFailed(Exception):
    pass


def _sse_error(message: str) -> bytes:
    body = error_body(503, message, code="replica_failed")
    return b"data: " + json.dumps(body).encode() + b"\n\n" + SSE_DONE


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}


async def _read_body(request: Request, limit: int) -> bytes | Response:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return error_response(413, f"request body exceeds {limit} bytes (max_request_bytes)",
                                  param="max_request_bytes", code="request_too_large")
    return bytes(body)


# Serve copies this class with the module's globals as they are here: helpers go above.
@serve.ingress(app)
class Ingress:
    def __init__(self, replicas: list, router: str = "prefix", router_config: dict | None = None,
                 api_key: str | None = None, max_request_bytes: int = 4 * 1024 * 1024):
        self.replicas = replicas  # DeploymentHandles, one per replica deployment
        n = len(replicas)
        self.router = make_router(router, n, RouterConfig(**(router_config or {})))
        self.loads = [0] * n
        self.up = [True] * n  # serve.run returned: every replica started
        self.instances: list[str | None] = [None] * n
        self.metrics = IngressMetrics(n)
        self.key = api_key.encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self._prober: asyncio.Task | None = None

    # --------------------------------------------------------------- replica state
    def _ensure_prober(self) -> None:
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._probe(i) for i in range(len(self.replicas))))
            await asyncio.sleep(PROBE_INTERVAL_S)

    async def _probe(self, i: int) -> None:
        try:
            info = await asyncio.wait_for(self.replicas[i].ping.remote(), PROBE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure to answer means: not up
            self._mark_down(i, f"it did not answer a ping ({type(e).__name__})")
            return
        if not info["alive"]:
            self._mark_down(i, "its server exited")
            return
        if info["instance"] != self.instances[i]:
            if self.instances[i] is not None:
                logger.warning("replica %d is back as a new instance (pid %s)", i, info["pid"])
                self.metrics.restarts.labels(str(i)).inc()
                self.router.forget(i)
            self.instances[i] = info["instance"]
        if not self.up[i]:
            logger.warning("replica %d is up again", i)
            self.up[i] = True

    def _mark_down(self, i: int, why: str) -> None:
        if self.up[i]:
            logger.error("replica %d is down: %s; routing around it until Ray Serve restarts it", i, why)
        self.up[i] = False
        self.router.forget(i)

    def _failed(self, i: int, why: str) -> str:
        self.metrics.replica_errors.labels(str(i)).inc()
        self._mark_down(i, why)
        return f"replica {i} failed while serving this request ({why}); it is being restarted, retry the request"

    # --------------------------------------------------------------- routes handled here
    def _auth_error(self, request: Request) -> Response | None:
        if self.key is None:
            return None
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip().encode() if auth[:7].lower() == "bearer " else b""
        if hmac.compare_digest(given, self.key):
            return None
        message = "invalid API key" if given else "missing API key: send 'Authorization: Bearer <key>'"
        return error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health")
    async def health(self) -> Response:
        self._ensure_prober()
        replicas = [{"replica": i, "up": self.up[i], "in_flight": self.loads[i]} for i in range(len(self.replicas))]
        if not any(self.up):
            return JSONResponse({"status": "unavailable", "replicas": replicas}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": replicas})

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._ensure_prober()
        if (denied := self._auth_error(request)) is not None:
            return denied
        stats = await asyncio.gather(*(self._stats(i) for i in range(len(self.replicas))))
        tree = [self.router.tree_chars(i) for i in range(len(self.replicas))]
        return Response(self.metrics.render(self.up, self.loads, tree, stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _stats(self, i: int) -> dict:
        if not self.up[i]:
            return {}
        try:
            return await asyncio.wait_for(self.replicas[i].stats.remote(), STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a scrape must not fail because one replica is slow
            return {}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(self, request: Request) -> Response:
        self._ensure_prober()
        if (denied := self._auth_error(request)) is not None:
            return denied
        live = [i for i in range(len(self.replicas)) if self.up[i]]
        headers = _forward_headers(request)
        results = await asyncio.gather(*(self._call(i, "POST", "/flush_cache", "", headers, b"") for i in live))
        failed = [f"replica {i}: {body.decode(errors='replace')[:200]}" for i, (status, body) in zip(live, results)
                  if status != 200]
        for i in live:
            self.router.forget(i)
        if failed:
            return error_response(409, "cannot flush every replica's cache: " + "; ".join(failed), code="busy")
        return JSONResponse({"success": True, "message": f"cache flushed on {len(live)} replica(s)"})

    async def _call(self, i: int, method: str, path: str, query: str, headers: dict, body: bytes) -> tuple[int, bytes]:
        """A whole (non-streamed) exchange with replica i: (status, body); 503 if it failed."""
        gen = self.replicas[i].options(stream=True).forward.remote(method, path, query, headers, body)
        chunks, status = [], 503
        try:
            async for item in gen:
                if isinstance(item, dict) and "error" in item:
                    return 503, json.dumps(error_body(503, self._failed(i, item["error"]))).encode()
                if isinstance(item, dict):
                    status = item["status"]
                else:
                    chunks.append(item)
        except Exception as e:  # noqa: BLE001 - the replica's actor died or Ray lost it
            return 503, json.dumps(error_body(503, self._failed(i, type(e).__name__))).encode()
        return status, b"".join(chunks)

    # --------------------------------------------------------------- everything else: one replica
    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def proxy(self, request: Request, path: str) -> Response:
        self._ensure_prober()
        if (denied := self._auth_error(request)) is not None:
            return denied
        body = await _read_body(request, self.max_request_bytes)
        if isinstance(body, Response):
            return body
        path = "/" + path
        key = None
        if request.method in ("POST", "PUT") and path in GENERATION_PATHS:
            try:
                key = routing_key(path, json.loads(body))
            except ValueError:  # not JSON: the replica's server answers with the proper 400
                key = None
        try:
            decision = self.router.choose(key, self.loads, self.up)
        except NoReplicaUp:
            return error_response(503, "no replica is up; Ray Serve is restarting them, retry shortly",
                                  code="no_replica", headers={"Retry-After": "5"})
        i = decision.replica
        self.metrics.decision(i, decision.reason, decision.matched_chars, len(key or ""))
        self.loads[i] += 1
        released, streaming = False, False

        def release() -> None:
            nonlocal released
            if not released:
                released, self.loads[i] = True, self.loads[i] - 1

        gen = self.replicas[i].options(stream=True).forward.remote(
            request.method, path, request.url.query, _forward_headers(request), body)
        try:
            head = await gen.__anext__()
            if "error" in head:
                raise _ReplicaFailed(head["error"])
            headers = {**head["headers"], "X-RadixLM-Replica": str(i)}
            if head["headers"].get("content-type", "").startswith("text/event-stream"):
                streaming = True  # the relay releases the load when the stream ends
                return StreamingResponse(self._relay(i, gen, release), status_code=head["status"], headers=headers)
            chunks = []
            async for item in gen:
                if isinstance(item, dict):
                    raise _ReplicaFailed(item["error"])
                chunks.append(item)
            return Response(b"".join(chunks), status_code=head["status"], headers=headers)
        except _ReplicaFailed as e:
            return error_response(503, self._failed(i, str(e)), code="replica_failed")
        except asyncio.CancelledError:
            gen.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the replica's actor died or Ray lost it
            return error_response(503, self._failed(i, f"{type(e).__name__}"), code="replica_failed")
        finally:
            if not streaming:
                release()

    async def _relay(self, i: int, gen, release: Callable[[], None]) -> AsyncIterator[bytes]:
        """A started stream: chunks as they come; if the replica dies, an SSE error event and [DONE]."""
        done = False
        try:
            async for item in gen:
                if isinstance(item, dict):
                    raise _ReplicaFailed(item["error"])
                yield item
            done = True
        except _ReplicaFailed as e:
            yield _sse_error(self._failed(i, str(e)))
        except Exception as e:  # noqa: BLE001 - the replica's actor died mid-stream
            yield _sse_error(self._failed(i, type(e).__name__))
        finally:
            if not done:
                gen.cancel()  # the client left (or the replica failed): stop the generation
            release()
