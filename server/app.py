"""The FastAPI app: a guard (API key, body size, per-route status counts), the native SGLang routes,
the OpenAI routes (openai_routes.py), and OpenAI-shaped errors for everything that goes wrong."""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse

from radixlm.runtime.core import Req
from radixlm.server import messages as m
from radixlm.server.errors import APIError, JSONResponse, bad_request
from radixlm.server.tokenizer_manager import ClientDisconnected, Group, ReqState, TokenizerManager

logger = logging.getLogger("radixlm.server.app")

PUBLIC_PATHS = frozenset({"/health"})
ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                    "/health_generate", "/metrics", "/flush_cache", "/server_info", "/get_server_info",
                    "/apply_chat_template", "/abort_request", "/get_model_info"})


class Guard:
    """ASGI middleware: Bearer auth (constant-time compare), Content-Length limit, status counts."""

    def __init__(self, app, api_key: str | None, max_bytes: int, metrics):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes
        self.metrics = metrics

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
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(route, str(status or 499)).inc()  # 499: client left first

    def _check(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
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


# ----------------------------------------------------------------------- helpers shared by the routes
async def read_json(request: Request, max_bytes: int) -> Any:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body exceeds {max_bytes} bytes (max_request_bytes)",
                           param="max_request_bytes", code="request_too_large")
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        data = msgspec.json.decode(bytes(body))
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def check_budget(tm: TokenizerManager, reqs: list[Req], name: str) -> None:
    """A prompt plus its max new tokens must fit the context (as SGLang checks)."""
    for req in reqs:
        n, want = len(req.input_ids), req.params.max_new_tokens
        if n + want > tm.context_len:
            raise APIError(400, f"{name}={want} plus the prompt's {n} tokens exceeds the context length "
                                f"({tm.context_len} tokens)", param=name)


def raise_request_error(state: ReqState) -> None:
    """A generation the runtime refused because of the request itself (e.g. a grammar that does not
    compile) is the client's error."""
    finish = state.finish
    if finish is not None and finish.type == "abort" and finish.code and 400 <= finish.code < 500:
        error = bad_request(finish.message or "invalid request")
        kind = re.match(r"invalid (\w+):", error.message)  # the grammar backends' "invalid <kind>: ..."
        error.param = error.param or (kind.group(1) if kind else None)
        raise error


async def first_event(group: Group, request: Request):
    """Waits for the first output before answering (so a refused request is still a 4xx)."""
    try:
        return await group.next(request)
    except BaseException:
        group.close()
        raise


# ----------------------------------------------------------------------- app
def create_app(tm: TokenizerManager, served_model: str) -> FastAPI:
    from radixlm.server.openai_routes import add_openai_routes

    args = tm.args
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        try:
            yield
        finally:
            await tm.stop()

    app = FastAPI(title="RadixLM", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.tm = tm
    app.state.draining = False

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        message = f"no route {request.method} {request.url.path}" if e.status_code in (404, 405) else str(e.detail)
        return APIError(e.status_code, message, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error ({type(e).__name__}); see the server log").response()

    # --------------------------------------------------------------- native routes
    @app.get("/health")
    async def health() -> Response:
        if tm.failed:
            return APIError(503, tm.failed).response()
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        built = tm.builder.build(None, [tm.tokenizer.bos_token_id or 0], {"max_new_tokens": 1, "temperature": 0},
                                 False, -1, 0, False, None)
        await submit(request, [r for g in built.groups for r, _ in g]).results(request)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": served_model, "object": "model", "created": int(tm.started), "owned_by": "radixlm",
            "root": tm.model_path, "max_model_len": tm.context_len}]})

    @app.get("/get_model_info")
    async def model_info() -> Response:
        return JSONResponse({"model_path": tm.model_path, "served_model_name": served_model,
                             "context_length": tm.context_len, "is_generation": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(tm.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if not await tm.call(m.FlushCacheReq):
            raise APIError(409, "cannot flush the cache while requests are running", code="busy")
        return JSONResponse({"success": True, "message": "cache flushed"})

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        info = await tm.call(m.ServerInfoReq)
        info.update(in_flight=len(tm.states), served_model_name=served_model)
        return JSONResponse(info)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await read_json(request, args.max_request_bytes)
        rid = body.get("rid")
        if not isinstance(rid, str):
            raise APIError(400, "rid must be a string", param="rid")
        tm.abort(rid)
        return JSONResponse({"success": rid in tm.states})

    @app.post("/apply_chat_template")
    async def apply_chat_template(request: Request) -> Response:
        body = await read_json(request, args.max_request_bytes)
        unknown = sorted(set(body) - {"messages", "add_generation_prompt", "tools"})
        if unknown:
            raise APIError(400, f"unknown field(s): {', '.join(unknown)}", param=unknown[0])
        messages, add = body.get("messages"), body.get("add_generation_prompt", True)
        if not isinstance(messages, list) or not all(isinstance(x, dict) for x in messages):
            raise APIError(400, "messages must be a list of objects", param="messages")
        if not isinstance(add, bool):
            raise APIError(400, "add_generation_prompt must be a boolean", param="add_generation_prompt")
        extra = {"tools": body["tools"]} if body.get("tools") else {}
        try:
            text = tm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add, **extra)
        except Exception as e:
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e
        return JSONResponse({"text": text})

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request, args.max_request_bytes)
        g = convert(body, GenerateRequest)
        try:
            built = tm.builder.build(g.text, g.input_ids, g.sampling_params, g.return_logprob, g.logprob_start_len,
                                     g.top_logprobs_num, g.stream, g.rid)
        except ValueError as e:
            raise bad_request(e) from e
        reqs = [r for group in built.groups for r, _ in group]
        check_budget(tm, reqs, "max_new_tokens")
        group = submit(request, reqs, stream=g.stream)
        index = {r.rid: i for i, r in enumerate(reqs)}

        def render(state: ReqState) -> dict:
            out = state.to_dict()
            if g.return_text_in_logprobs:
                _add_logprob_text(tm.tokenizer, out["meta_info"])
            if len(reqs) > 1:
                out["index"] = index[state.rid]
            return out

        if not g.stream:
            states = {s.rid: s for s in await group.results(request)}
            for s in states.values():
                raise_request_error(s)
            results = [[render(states[r.rid]) for r, _ in grp] for grp in built.groups]
            per_prompt = [res if len(res) > 1 else res[0] for res in results]
            return JSONResponse(per_prompt if built.is_batch else per_prompt[0])

        state, out = await first_event(group, request)
        raise_request_error(state)

        async def chunks() -> AsyncIterator[bytes]:
            s, o = state, out
            try:
                while True:
                    if o.text or o.new_ids or o.finish is not None:
                        yield sse(render(s))
                    if group.done:
                        break
                    s, o = await group.next()
                yield SSE_DONE
            finally:
                group.close()

        return StreamingResponse(chunks(), media_type="text/event-stream", headers=SSE_HEADERS)

    def submit(request: Request, reqs: list[Req], stream: bool = False) -> Group:
        if app.state.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        return tm.submit(reqs, stream=stream)

    app.state.submit = submit
    add_openai_routes(app, tm, served_model)
    app.add_middleware(Guard, api_key=args.api_key, max_bytes=args.max_request_bytes, metrics=tm.metrics)
    return app


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /generate body (GenerateReqInput), the fields RadixLM serves."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: dict[str, Any] | list[Any] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


def convert(body: dict, cls: type):
    """msgspec.convert with its errors as a 400 naming the field."""
    try:
        return msgspec.convert(body, cls)
    except msgspec.ValidationError as e:
        # "Expected `bool`, got `str` - at `$.stream`"; "Object contains unknown field `x`"
        text = str(e)
        if " - at `$." in text:
            message, path = text.rsplit(" - at `$.", 1)
            param = path.rstrip("`")
            raise APIError(400, f"{param}: {message[0].lower()}{message[1:]}", param=param) from e
        if text.startswith("Object contains unknown field"):
            param = text.split("`")[1]
            raise APIError(400, f"unknown field {param!r} in the request body", param=param) from e
        raise APIError(400, text) from e


def _add_logprob_text(tokenizer, meta: dict) -> None:
    for key in ("input_token_logprobs", "output_token_logprobs"):
        for entry in meta.get(key, []):
            entry[2] = tokenizer.decode([entry[1]])
    for row in meta.get("output_top_logprobs", []):
        for entry in row:
            entry[2] = tokenizer.decode([entry[1]])
