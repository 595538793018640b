"""The leaf module under the route modules: reading a body, turning runtime errors into API errors,
submitting requests, SSE framing. Routes reach the app's TokenizerManager through `tm_of(request)`.

Nothing a client sends can raise past here as anything but an APIError: invalid UTF-8, JSON nested
past MAX_JSON_DEPTH and numbers out of range are 400s naming the problem, before any state exists.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import msgspec
from fastapi import Request

from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.req import Req
from radixlm.server.errors import APIError
from radixlm.server.openai_models import RequestModel, check_counts, count_raw, parse_request
from radixlm.server.request_state import Group, ReqState
from radixlm.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("radixlm.server")

MAX_JSON_DEPTH = 64  # deeper bodies (schemas, tool parameters, messages) are refused, not recursed into
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ApiNames(NamedTuple):
    """How an API spells the runtime's field names in its errors."""

    renames: ApiNames
    nested_sampling: bool  # sampling parameters sit under "sampling_params" (native) or at the top (OpenAI)


NATIVE_NAMES = ApiNames({"prompt": "text"}, True)
OPENAI_NAMES = ApiNames({"max_new_tokens": "max_tokens", "sampling_seed": "seed", "top_logprobs_num": "top_logprobs",
                         "min_new_tokens": "min_tokens", "return_logprob": "logprobs", "input_ids": "prompt"}, False)


def tm_of(request: Request) -> TokenizerManager:
    return request.app.state.tm


async def read_body(request: Request) -> bytes:
    """The raw body, refused (413) past max_request_bytes and (400) when empty. Only this part runs
    on the event loop: decoding and validating a large body takes long (read_json, read_model)."""
    max_bytes = tm_of(request).args.max_request_bytes
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise APIError(413, f"request body exceeds {max_bytes} bytes (max_request_bytes)",
                           param="max_request_bytes", code="request_too_large")
    if not body:
        raise APIError(400, "the request body is empty; send a JSON object")
    request.state.body_bytes = len(body)
    return bytes(body)


def decode_json(body: bytes, cls: type[RequestModel] | None = None) -> dict[str, Any]:
    """A body as a JSON object (no deeper than MAX_JSON_DEPTH); 400 for anything else. With the
    request model `cls`, its lists are counted (check_counts) before the depth walk visits them."""
    try:
        data = msgspec.json.decode(body)
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from e
    except RecursionError as e:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from e
    except msgspec.DecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if cls is not None:
        check_counts(cls, data)
    check_depth(data)
    return data


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, decoded on a tokenizer thread; 400/413 for anything else."""
    body = await read_body(request)
    return await tm_of(request).run_blocking(len(body), decode_json, body)


async def read_model(request: Request, cls: type[RequestModel]) -> Any:
    """The body as a request model (openai_models.parse_request): decoded, counted and validated on a
    tokenizer thread, so a body of many messages never holds up /health or another request."""
    body = await read_body(request)
    return await tm_of(request).run_blocking(len(body), _parse_body, cls, body)


def _parse_body(cls: type[RequestModel], body: bytes) -> Any:
    count_raw(cls, body)
    return parse_request(cls, decode_json(body, cls))


async def read_fields(request: Request, allowed: set[str]) -> dict[str, Any]:
    """read_json for a route whose body has a fixed set of fields: 400 naming any other."""
    body = await read_json(request)
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r} in the request body", param=unknown[0])
    return body


def check_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """400 naming the top-level field under which `value` nests deeper than `limit` (iterative: a
    deep value never reaches the recursion limit here)."""
    stack = [(v, 1, k) for k, v in value.items()] if isinstance(value, dict) else [(value, 0, None)]
    while stack:
        item, depth, field = stack.pop()
        if depth > limit:
            raise APIError(400, f"{field or 'the body'} nests deeper than {limit} levels", param=field)
        if isinstance(item, dict):
            stack.extend((v, depth + 1, field) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1, field) for v in item)


def api_error(e: RequestError, names: ApiNames) -> APIError:
    """A runtime RequestError as a 4xx naming the field the way this API spells it."""
    public = names.renames.get(e.field, e.field) if e.field else None
    if e.section == "sampling_params" and names.nested_sampling and public:
        public = f"sampling_params.{public}"
    message = e.describe(public)
    renamed = names.renames.get(e.field) if e.field else None
    if e.named and renamed and message.startswith(f"invalid {e.field}"):
        message = f"invalid {renamed}{message[len(e.field) + 8:]}"  # a backend's message, in this API's words
    return APIError(e.status, message, param=public)


async def off_loop(request: Request, names: ApiNames, fn, *args: Any) -> Any:
    """fn(*args) on a tokenizer thread (never on the event loop), RequestErrors as API errors."""
    try:
        return await tm_of(request).run_blocking(getattr(request.state, "body_bytes", 0), fn, *args)
    except RequestError as e:
        raise api_error(e, names) from e


async def build(request: Request, names: ApiNames, *args: Any, **options: Any) -> tuple[list[list[Req]], bool]:
    """RequestBuilder.build (the Engine's validation) off the event loop, errors as API errors; a
    request with more generations than the server can ever hold at once is a 400, not a 503."""
    prompt, input_ids = args[0], args[1]
    nested_ids = isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)
    batch = prompt if isinstance(prompt, list) else input_ids if nested_ids else []
    check_count(request, len(batch), "prompt" if prompt is not None else "input_ids", names)
    tm = tm_of(request)
    built = await off_loop(request, names, functools.partial(tm.builder.build, max_generations=tm.max_in_flight,
                                                             **options), *args)
    return built.groups, built.is_batch


def check_count(request: Request, count: int, field: str, names: ApiNames) -> None:
    limit = tm_of(request).max_in_flight
    if count > limit:
        problem = (f"asks for {count} generations, more than this server ever holds at once ({limit}: "
                   "max_running_requests + max_queued_requests); split the request")
        raise api_error(RequestError(field, problem, section="sampling_params" if field == "n" else None), names)


async def tokenize(request: Request, text: str, names: ApiNames) -> list[int]:
    return await off_loop(request, names, tm_of(request).builder.tokenize, text)


def submit(request: Request, reqs: list[Req], stream: bool = False) -> Group:
    if request.app.state.draining:
        raise APIError(503, "server is shutting down", code="shutting_down")
    return tm_of(request).submit(reqs, stream=stream, scope=request.scope)


def raise_request_error(state: ReqState, names: ApiNames, any_abort: bool = False) -> None:
    """A generation the runtime refused because of the request itself (e.g. a grammar that does not
    compile) is the client's error, naming the field the runtime named; one that failed inside (a
    coded abort: 500, 503 while shutting down, 504 past max_request_seconds) is that status. A
    plain abort (a client's /abort_request) raises only with `any_abort` (OpenAI routes: 500)."""
    constraint = state.req.params.constraint
    error = RequestError.from_finish(state.finish, constraint[0] if constraint else None)
    if error is not None:
        raise api_error(error, names)
    finish = state.finish
    if finish is not None and finish.type == "abort" and (finish.code or any_abort):
        raise finish_error(finish)


def finish_error(finish) -> APIError:
    return APIError(finish.code or 500, f"generation aborted: {finish.message or 'no reason given'}")


async def guarded_sse(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body that always ends well-formed: an unexpected error becomes a final error event
    and [DONE], never a connection cut mid-body."""
    try:
        async for event in events:
            yield event
    except Exception as e:
        logger.exception("error while streaming a response")
        yield sse(APIError(500, f"internal server error while streaming ({type(e).__name__}); see the server "
                                "log").body())
        yield SSE_DONE
    finally:
        await events.aclose()  # its own cleanup (aborting what is unfinished) now, not at garbage collection


async def first_event(group: Group, request: Request, names: ApiNames) -> tuple[ReqState, Any]:
    """Waits for the first output before a stream starts, so a refused request is still a 4xx
    (and its siblings are aborted)."""
    try:
        first = await group.next(request)
        raise_request_error(first[0], names)
        return first
    except BaseException:
        group.close()
        raise


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"
