"""Health, metrics, cache and info routes, with SGLang's aliases (/get_server_info, /model_info...)."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response

from radixlm.server.common import NATIVE_NAMES as NAMES
from radixlm.server.common import build, read_fields, submit, tm_of
from radixlm.server.errors import APIError, JSONResponse
from radixlm.server.openapi_doc import docs_page

router = APIRouter()


@router.get("/health")
@router.get("/ping")
async def health(request: Request) -> Response:
    tm = tm_of(request)
    if tm.failed:
        return APIError(503, tm.failed).response()
    if request.app.state.draining:  # load balancers stop sending here
        return APIError(503, "server is shutting down", code="shutting_down").response()
    silent = tm.scheduler_stalled()
    if silent is not None:
        return APIError(503, f"the scheduler loop has not made progress for {silent:.0f}s (a step is stuck or "
                             "very slow)", code="scheduler_stalled").response()
    return JSONResponse({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy only if a one-token generation goes through the whole pipeline."""
    tm = tm_of(request)
    groups, _ = await build(request, NAMES, None, [tm.tokenizer.bos_token_id or 0], {"max_new_tokens": 1,
                                                                               "temperature": 0},
                      False, -1, 0, False, None)
    await submit(request, [r for g in groups for r in g]).results(request)
    return JSONResponse({"status": "ok"})


@router.get("/docs", response_class=HTMLResponse)
async def docs(request: Request) -> Response:
    """The routes for people (the page fetches nothing: no script, no CDN); /openapi.json for tools."""
    return HTMLResponse(docs_page(request.app.openapi()),
                        headers={"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'"})


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(request: Request) -> Response:
    tm = tm_of(request)
    return JSONResponse({"model_path": tm.model_path, "tokenizer_path": tm.model_path,
                         "served_model_name": request.app.state.served_model, "context_length": tm.context_len,
                         "is_generation": True, "weight_version": "default"})


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> Response:
    tm = tm_of(request)
    info = await tm.call("server_info")  # the engine's options and state
    secret = ("api_key", "api_key_file")
    own = {k: v for k, v in dataclasses.asdict(tm.args).items() if k not in info and k not in secret}
    info.update(own, in_flight=len(tm.states), served_model_name=request.app.state.served_model)
    return JSONResponse(info)


@router.get("/metrics", response_class=PlainTextResponse)  # documented as text/plain in /openapi.json
async def metrics(request: Request) -> Response:
    return Response(tm_of(request).metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/flush_cache")  # state-changing: POST only (a GET can be triggered by any page or prefetch)
async def flush_cache(request: Request) -> Response:
    tm = tm_of(request)
    if not await tm.call("flush_cache"):
        raise APIError(409, "cannot flush the cache while requests are running", code="busy")
    tm.builder.token_cache.clear()  # the next request is tokenized as a cold one is
    return JSONResponse({"success": True, "message": "cache flushed"})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """SGLang's {"rid": ...} or {"abort_all": true}."""
    body = await read_fields(request, {"rid", "abort_all", "finished_reason", "abort_message"})
    tm = tm_of(request)
    if body.get("abort_all") is True:
        count = len(tm.states)
        tm.abort(None)
        return JSONResponse({"success": True, "aborted": count})
    rid = body.get("rid")
    if not isinstance(rid, str):
        raise APIError(400, "rid must be a string (or send abort_all: true)", param="rid")
    found = rid in tm.states
    tm.abort(rid)
    return JSONResponse({"success": found})
