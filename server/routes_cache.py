"""The radix cache for people and operators: GET /cache (summary), GET /cache/tree (structure),
GET /cache/view (a live page: static HTML + script from server/static, no CDN, no build step) and
POST /cache/save|load (KV snapshots to and from the operator's --cache-snapshot file).

Everything the scheduler knows comes through control calls (the scheduler thread answers; token ids
come back and are decoded here, off the event loop). Like every route but /health these need the
API key when one is set; so that a person can open the page in a browser, GET requests under /cache
also take the key as the password of HTTP Basic auth (app.Guard). No request names a file: save and
load take no body, and the wire message that reaches the scheduler carries integers only.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from radixlm.runtime.scheduler.cache_calls import MAX_DEPTH, MAX_TOP, MAX_TREE_NODES, decode_heads
from radixlm.server.common import read_json, tm_of
from radixlm.server.errors import APIError, JSONResponse

router = APIRouter()

STATIC = Path(__file__).with_name("static")
PAGE_HEADERS = {
    # the page runs only its own script; cached text is inserted as text (textContent), never as markup
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
}
STATIC_TYPES = {"view.js": ("cache_view.js", "text/javascript; charset=utf-8"),
                "view.css": ("cache_view.css", "text/css; charset=utf-8")}
# snapshot failures (runtime/scheduler/snapshot_file.SnapshotError kinds) as HTTP statuses
MAX_MIN_TOKENS = 2**62  # any pool; the wire carries 64-bit integers
SNAPSHOT_STATUS = {"busy": 409, "unconfigured": 409, "disabled": 409, "refused": 409, "failed": 500}


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    # ASCII digits only: int() also reads "٣" (an Arabic-Indic three), " +8" and "1_0"
    if not (raw.isascii() and raw.removeprefix("-").isdigit()):
        raise APIError(400, f"{name} must be an integer written in ASCII digits, got {raw[:50]!r}", param=name)
    value = int(raw)
    if not low <= value <= high:
        raise APIError(400, f"{name} must be between {low} and {high}, got {value}", param=name)
    return value


def _only_params(request: Request, allowed: set[str]) -> None:
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise APIError(400, f"unknown query parameter {unknown[0]!r}", param=unknown[0])


def _query_doc(*params: tuple[str, int, int, str]) -> dict:
    """The query parameters in /openapi.json (the routes read them themselves, for 400s naming them)."""
    return {"parameters": [{"name": n, "in": "query", "required": False, "description": d,
                            "schema": {"type": "integer", "minimum": low, "maximum": high}}
                           for n, low, high, d in params]}


async def _decoded(request: Request, answer: dict) -> dict:
    tm = tm_of(request)
    return await tm.run_blocking(0, decode_heads, answer, tm.tokenizer)


@router.get("/cache", openapi_extra=_query_doc(("top", 1, MAX_TOP, "how many top prefixes (default 10)")))
@router.get("/cache/summary", include_in_schema=False)  # the page's name for it (its Basic auth covers /cache/*)
async def cache_summary(request: Request) -> Response:
    """Sizes (pool, cached, locked, evictable, free), node count, the top prefixes by tokens saved
    (text head, length, hits, tokens saved, last use, locked), hit rates over 1/5/15 minutes,
    evictions by reason, snapshot state, and the last minutes of TTFT / hit rate / load."""
    _only_params(request, {"top"})
    top = _int_param(request, "top", 10, 1, MAX_TOP)
    answer = await _decoded(request, await tm_of(request).call("cache_summary", top=top))
    answer["series"] = tm_of(request).metrics.series.to_dict()
    return JSONResponse(answer, headers={"Cache-Control": "no-store"})


@router.get("/cache/tree", openapi_extra=_query_doc(
    ("depth", 1, MAX_DEPTH, "edges below the root (default 8)"),
    ("min_tokens", 0, MAX_MIN_TOKENS, "leave out subtrees holding fewer cached tokens (default 0)"),
    ("max_nodes", 1, MAX_TREE_NODES, "nodes at most, largest subtrees first (default 500)")))
async def cache_tree(request: Request) -> Response:
    """The tree's structure: one entry per node (id, parent, depth, edge / prefix / subtree tokens,
    hits, last use, locked, decoded text of the edge's head, what was left out below it)."""
    _only_params(request, {"depth", "min_tokens", "max_nodes"})
    args = {"depth": _int_param(request, "depth", 8, 1, MAX_DEPTH),
            "min_tokens": _int_param(request, "min_tokens", 0, 0, MAX_MIN_TOKENS),
            "max_nodes": _int_param(request, "max_nodes", 500, 1, MAX_TREE_NODES)}
    answer = await _decoded(request, await tm_of(request).call("cache_tree", **args))
    return JSONResponse(answer, headers={"Cache-Control": "no-store"})


@functools.cache
def _static(name: str) -> bytes:
    return (STATIC / name).read_bytes()


@router.get("/cache/view", include_in_schema=False)
async def cache_view(request: Request) -> Response:
    """The live page. It holds no cached text itself: its script fetches /cache/summary and
    /cache/tree with the browser's credentials."""
    return Response(_static("cache_view.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


@router.get("/cache/view.js", include_in_schema=False)
@router.get("/cache/view.css", include_in_schema=False)
async def cache_view_asset(request: Request) -> Response:
    name, media_type = STATIC_TYPES[request.url.path.rsplit("/", 1)[1]]
    return Response(_static(name), media_type=media_type, headers=PAGE_HEADERS)


async def _no_body(request: Request) -> None:
    """Save and load take no body; a field (a path above all) is a 400 naming it."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return
    body = await read_json(request)
    if body:
        field = sorted(body)[0]
        why = "the snapshot file is the server's --cache-snapshot; a request cannot name one" \
            if field in ("path", "file", "filename") else "this route takes no body"
        raise APIError(400, f"unknown field {field!r}: {why}", param=field)


async def _snapshot(request: Request, name: str) -> Response:
    await _no_body(request)
    record: dict[str, Any] = await tm_of(request).call(name, timeout=600.0)
    if not record.get("ok"):
        kind = record.get("error", "failed")
        raise APIError(SNAPSHOT_STATUS.get(kind, 500), record.get("message", "snapshot failed"),
                       code=f"snapshot_{kind}")
    return JSONResponse({"success": True, **record})


@router.post("/cache/save")
async def cache_save(request: Request) -> Response:
    """Saves the hottest part of the cache (at most --cache-snapshot-max-tokens tokens) to the
    --cache-snapshot file, atomically, while requests keep running; answers with the figures."""
    return await _snapshot(request, "cache_save")


@router.post("/cache/load")
async def cache_load(request: Request) -> Response:
    """Adds the --cache-snapshot file to the cache. A file of another model, dtype, tokenizer or
    version, or a truncated or corrupt one, is refused (409, nothing from it used)."""
    return await _snapshot(request, "cache_load")
