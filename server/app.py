"""The FastAPI app: three routers (routes_openai, routes_native, routes_admin) over one leaf module
(common.py), a guard (API key, body size, per-route status counts), CORS, and OpenAI-shaped errors
for everything that goes wrong."""

from __future__ import annotations

import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from radixlm.runtime.errors import RequestError
from radixlm.server import routes_admin, routes_native, routes_openai
from radixlm.server.common import NATIVE_NAMES, api_error
from radixlm.server.errors import APIError
from radixlm.server.tokenizer_manager import ClientDisconnected, TokenizerManager

logger = logging.getLogger("radixlm.server.app")

PUBLIC_PATHS = frozenset({"/health", "/ping"})


class Guard:
    """ASGI middleware: Bearer auth (constant-time compare), Content-Length limit, status counts."""

    def __init__(self, app, api_key: str | None, max_bytes: int, metrics, routes: frozenset[str]):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 0

        async def send_and_count(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            error = self._check(scope)
            if error is not None:
                await error.response()(scope, receive, send_and_count)
            else:
                await self.app(scope, receive, send_and_count)
        finally:
            route = scope["path"] if scope["path"] in self.routes else "other"
            self.metrics.request(route, status or 499)  # 499: the client left first

    def _check(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        if scope["method"] == "OPTIONS":  # CORS preflight: answered by the CORS layer, no key needed
            return None
        if self.key is not None and scope["path"] not in PUBLIC_PATHS:
            auth = headers.get(b"authorization", b"")
            given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                message = "invalid API key" if given else "missing API key: send 'Authorization: Bearer <key>'"
                return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return APIError(413, f"request body is {int(length)} bytes, the limit is {self.max_bytes} "
                                 "(max_request_bytes)", param="max_request_bytes", code="request_too_large")
        return None


async def _api_error(request: Request, e: APIError) -> Response:
    return e.response()


async def _request_error(request: Request, e: RequestError) -> Response:
    return api_error(e, NATIVE_NAMES).response()


async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
    message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
    return APIError(e.status_code, message, headers=getattr(e, "headers", None)).response()


async def _gone(request: Request, e: ClientDisconnected) -> Response:
    return Response(status_code=499)


async def _internal(request: Request, e: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return APIError(500, f"internal server error ({type(e).__name__}); see the server log").response()


def create_app(tm: TokenizerManager, served_model: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        try:
            yield
        finally:
            await tm.stop()

    app = FastAPI(title="RadixLM", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.tm = tm
    app.state.served_model = served_model
    app.state.draining = False
    for router in (routes_openai.router, routes_native.router, routes_admin.router):
        app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestError, _request_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnected, _gone)
    app.add_exception_handler(Exception, _internal)
    args = tm.args
    routes = frozenset(r.path for router in (routes_openai.router, routes_native.router, routes_admin.router)
                       for r in router.routes)
    origins = [o.strip() for o in (args.allowed_origins or "").split(",") if o.strip()]
    if origins:  # added first: the Guard runs outside it and lets preflights through
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=True, allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(Guard, api_key=args.api_key, max_bytes=args.max_request_bytes, metrics=tm.metrics,
                       routes=routes)
    return app
