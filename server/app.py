"""The FastAPI app: three routers (routes_openai, routes_native, routes_admin) over one leaf module
(common.py), a guard (Origin check, API key or Host check, body size, per-route status counts, the
last-resort 500), CORS, and OpenAI-shaped errors for everything that goes wrong."""

from __future__ import annotations

import base64
import contextlib
import hmac
import ipaddress
import logging

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from radixlm.runtime.request.errors import RequestError
from radixlm.server import routes_admin, routes_cache, routes_native, routes_openai, routes_responses
from radixlm.server.common import NATIVE_NAMES, SSE_DONE, api_error, sse
from radixlm.server.errors import APIError
from radixlm.server.openapi_doc import install_openapi
from radixlm.server.request_state import ClientDisconnected
from radixlm.server.tokenizer_manager import Arrivals, TokenizerManager

logger = logging.getLogger("radixlm.server.app")

PUBLIC_PATHS = frozenset({"/health", "/ping"})


class Guard:
    """ASGI middleware: an Origin check against cross-site requests; Bearer auth (constant-time
    compare) or, without a key, a Host check against DNS rebinding; Content-Length limit; status
    counts; and the answer to an unexpected exception.

    That answer is given here rather than by an exception handler for Exception: Starlette re-raises
    after such a handler has answered, and uvicorn then closes the client's keep-alive connection."""

    def __init__(self, app, api_key: str | None, max_bytes: int, metrics, routes: frozenset[str],
                 hosts: frozenset[str], origins: frozenset[str]):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.routes = routes
        self.hosts = hosts  # "*": any
        self.origins = origins  # "*": any

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status, sse_body, ended = 0, False, False

        async def send_and_count(message) -> None:
            nonlocal status, sse_body, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                sse_body = any(k == b"content-type" and v.startswith(b"text/event-stream")
                               for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            error = self._check(scope)
            if error is not None:
                await error.response()(scope, receive, send_and_count)
            else:
                await self.app(scope, receive, send_and_count)
        except Exception as e:
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            answer = APIError(500, f"internal server error ({type(e).__name__}); see the server log")
            if not status:
                await answer.response()(scope, receive, send_and_count)
            elif not ended:  # mid-body: end it well-formed (a final error event for a stream)
                tail = sse(answer.body()) + SSE_DONE if sse_body else b""
                await send_and_count({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.request(route, status or 499)  # 499: the client left first

    def _check(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin, headers.get(b"host")):
            # a page on another site can POST here without a preflight (text/plain is a "simple" request):
            # CORS only hides the answer from it, so the request itself is refused, preflights included
            return APIError(403, f"Origin {origin.decode('latin-1')[:200]!r} is not allowed: requests from web pages "
                                 "are accepted only from this server's own origin and --allowed-origins",
                            code="origin_not_allowed")
        if scope["method"] == "OPTIONS":  # CORS preflight: answered by the CORS layer, no key needed
            return None
        if self.key is None and not self._host_allowed(headers.get(b"host")):
            return APIError(403, f"Host {headers[b'host'].decode('latin-1')!r} is not allowed: without an API key "
                                 "only IP addresses, localhost and the bind address are (DNS rebinding); set "
                                 "--api-key or --allowed-hosts", code="host_not_allowed")
        if self.key is not None and scope["path"] not in PUBLIC_PATHS:
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            browser = _browser_page(scope)
            if browser and auth[:6].lower() == b"basic ":
                given = _basic_password(auth[6:])
            if not hmac.compare_digest(given, self.key):
                message = "invalid API key" if given else "missing API key: send 'Authorization: Bearer <key>'"
                # a browser asks for a password on a Basic challenge (any user name, the key as password)
                challenge = 'Basic realm="RadixLM", charset="UTF-8"' if browser else "Bearer"
                return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": challenge})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return APIError(413, f"request body is {int(length)} bytes, the limit is {self.max_bytes} "
                                 "(max_request_bytes)", param="max_request_bytes", code="request_too_large")
        return None

    def _origin_allowed(self, origin: bytes, host: bytes | None) -> bool:
        """Listed (compared exactly, as the CORS layer does), or this server's own origin: the page's
        scheme://host:port names what the Host header names (default ports left out by browsers)."""
        text = origin.decode("latin-1")
        if "*" in self.origins or text in self.origins:
            return True
        scheme, sep, netloc = text.lower().partition("://")
        if not sep or host is None:  # "null" (sandboxed frames, file: pages) is never this server
            return False
        default = {"http": ":80", "https": ":443"}.get(scheme, "")
        own = host.decode("latin-1").strip().lower()
        return bool(netloc) and netloc.removesuffix(default) == own.removesuffix(default)

    def _host_allowed(self, host: bytes | None) -> bool:
        """A rebinding page reaches us under its own domain name; an IP literal cannot be rebound."""
        if host is None or "*" in self.hosts:
            return True
        name = host.decode("latin-1").strip().lower()
        name = name[1:].split("]")[0] if name.startswith("[") else name.rsplit(":", 1)[0] if name.count(":") == 1 \
            else name
        name = name.rstrip(".")
        if name in self.hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True


class CountArrivals:
    """ASGI middleware: a generation request counts as on its way to the scheduler from here until
    it is submitted, or answered if it fails first (tokenizer_manager.Arrivals)."""

    def __init__(self, app, arrivals: Arrivals):
        self.app = app
        self.arrivals = arrivals

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in Arrivals.PATHS:
            return await self.app(scope, receive, send)
        self.arrivals.begin(scope)
        try:
            await self.app(scope, receive, send)
        finally:
            self.arrivals.end(scope)


def _browser_page(scope) -> bool:
    """GET /cache and below: what a person opens in a browser (routes_cache.py), where the key may
    also come as HTTP Basic auth, since a browser cannot send a Bearer header when opening a page."""
    path = scope["path"]
    return scope["method"] in ("GET", "HEAD") and (path == "/cache" or path.startswith("/cache/"))


def _basic_password(token: bytes) -> bytes:
    try:
        return base64.b64decode(token.strip(), validate=True).partition(b":")[2]
    except ValueError:
        return b""


def allowed_hosts(bind_host: str, extra: str) -> frozenset[str]:
    names = {"localhost", bind_host.strip("[]").lower()}
    return frozenset(names | {h.strip().lower().rstrip(".") for h in extra.split(",") if h.strip()})


def cors_options(allowed_origins: str) -> dict | None:
    """CORSMiddleware's options for --allowed-origins, None when it names none (no CORS). Credentials
    are never allowed with "*": any site could then act with the user's cookies or HTTP auth."""
    origins = [o.strip() for o in allowed_origins.split(",") if o.strip()]
    if not origins:
        return None
    return {"allow_origins": origins, "allow_credentials": "*" not in origins, "allow_methods": ["*"],
            "allow_headers": ["*"]}


async def _api_error(request: Request, e: APIError) -> Response:
    return e.response()


async def _request_error(request: Request, e: RequestError) -> Response:
    return api_error(e, NATIVE_NAMES).response()


async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
    return APIError(e.status_code, message, headers=getattr(e, "headers", None)).response()


async def _gone(request: Request, e: ClientDisconnected | ClientDisconnect) -> Response:
    # nothing to fix on our side (the client closed mid-upload or mid-wait): one debug line, no traceback
    logger.debug("client disconnected during %s %s", request.method, request.url.path)
    return Response(status_code=499)


ROUTERS = (routes_openai.router, routes_responses.router, routes_native.router, routes_admin.router,
           routes_cache.router)


def _bare_app(**kwargs) -> FastAPI:
    """The routes and their /openapi.json, without a runtime behind them."""
    app = FastAPI(title="RadixLM", version="0.1.0", docs_url=None, redoc_url=None, **kwargs)
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app)
    return app


def openapi_document() -> dict:
    """The /openapi.json every server publishes (built without a server: tests fuzz from it)."""
    return _bare_app().openapi()


def create_app(tm: TokenizerManager, served_model: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        try:
            yield
        finally:
            await tm.stop()

    app = _bare_app(lifespan=lifespan)
    app.state.tm = tm
    app.state.served_model = served_model
    app.state.draining = False
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnected, _gone)
    app.add_exception_handler(ClientDisconnect, _gone)  # starlette's: the body stopped mid-upload
    args = tm.args
    routes = frozenset(r.path for router in ROUTERS for r in router.routes)
    cors = cors_options(args.allowed_origins or "")
    app.add_middleware(CountArrivals, arrivals=tm.arrivals)  # inside the Guard: refused requests never count
    if cors is not None:  # added first: the Guard runs outside it and lets allowed preflights through
        app.add_middleware(CORSMiddleware, **cors)
    app.add_middleware(Guard, api_key=args.api_key, max_bytes=args.max_request_bytes, metrics=tm.metrics,
                       routes=routes, hosts=allowed_hosts(args.host, args.allowed_hosts),
                       origins=frozenset(cors["allow_origins"] if cors else ()))
    return app
