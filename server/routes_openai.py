"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models[/{id}].

Single-model mode: any model name is served in a request (SGLang's "default" included); responses
name the served model. `GET /v1/models/{id}` knows only the served name and "default" (404 for
others, as OpenAI and vLLM)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from radixlm.runtime.request.reasoning import ReasoningFormat
from radixlm.runtime.request.req import Req
from radixlm.server import tool_calls, tool_stream
from radixlm.server.chat_tokens import chat_ids, sanitize_wanted
from radixlm.server.common import (
    OPENAI_NAMES,
    SSE_HEADERS,
    ApiNames,
    build,
    check_count,
    first_event,
    guarded_sse,
    off_loop,
    raise_request_error,
    read_model,
    submit,
    tm_of,
)
from radixlm.server.errors import APIError, JSONResponse
from radixlm.server.openai_convert import (
    chat_constraint,
    chat_logprobs,
    finish_reason,
    format_constraint,
    logprob_names,
    usage,
)
from radixlm.server.openai_models import ChatCompletionRequest, CompletionRequest
from radixlm.server.openai_stream import chat_stream, completion_choice_logprobs, completion_stream, tool_finish
from radixlm.server.reasoning import split as split_thinking
from radixlm.server.reasoning import thinking_format, wait_for_thinking
from radixlm.server.request_state import ReqState

router = APIRouter()
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _names(req: ChatCompletionRequest | CompletionRequest, tool_mode=None) -> ApiNames:
    """How errors name fields for this request: a constraint that came from vLLM's guided_* field
    is named by that field, one built from tools by the tool's parameters (or `tools`)."""
    guided = req.guided_constraint()
    if guided is None and req.structured_outputs is not None:
        guided = ("structured_outputs", req.structured_outputs.constraint())
    if tool_mode is not None and isinstance(req, ChatCompletionRequest):
        field = req.tool_field(tool_calls.schema_owner(*tool_mode))
        return ApiNames({**OPENAI_NAMES.renames, "json_schema": field, "structural_tag": field},
                        OPENAI_NAMES.nested_sampling)
    if guided is None:
        return OPENAI_NAMES
    (kind,) = guided[1]
    return ApiNames({**OPENAI_NAMES.renames, kind: guided[0]}, OPENAI_NAMES.nested_sampling)


async def _finished(group, request: Request, names: ApiNames) -> list[ReqState]:
    """Every generation's final state; a 4xx for a request the runtime refused, 500 for other aborts."""
    states = await group.results(request)
    for state in states:
        raise_request_error(state, names, any_abort=True)
    return states


async def _build(request: Request, names: ApiNames, token_lists: list[list[int]], params: dict, logprob: bool,
                 start: int, top: int, stream: bool, rid: str | None) -> list[Req]:
    groups, _ = await build(request, names, None, token_lists, params, logprob, start, top, stream, rid)
    return [r for group in groups for r in group]


def _card(request: Request) -> dict[str, Any]:
    tm = tm_of(request)
    return {"id": request.app.state.served_model, "object": "model", "created": int(tm.started),
            "owned_by": "radixlm", "root": tm.model_path, "max_model_len": tm.context_len}


@router.get("/v1/models")
async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_card(request)]})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    if model_id not in (request.app.state.served_model, "default"):  # "default": SGLang's name for the one model
        raise APIError(404, f"The model {model_id!r} does not exist (this server serves "
                            f"{request.app.state.served_model!r})", param="model", code="model_not_found")
    return JSONResponse(_card(request))


# ----------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    req = await read_model(request, ChatCompletionRequest)
    tm, served = tm_of(request), request.app.state.served_model
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    sanitize = sanitize_wanted(req.sanitize_control_tokens, tm.args.allow_control_tokens_in_content)
    tool_mode, ids, constraint = await off_loop(request, OPENAI_NAMES, _prepare_chat, req, tm, sanitize)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_new is None:  # the room left, capped by --default-max-tokens (and --max-request-seconds)
        max_new = tm.builder.default_max_new_tokens(len(ids), tm.args.default_max_tokens)
    params = {**req.sampling_params(max_new), **constraint}
    names = _names(req, tool_mode)
    reqs = await _build(request, names, [ids], params, req.logprobs, -1, req.top_logprobs or 0, req.stream, req.rid)
    reasoning = thinking_format(req, tm)
    if constraint:  # the model thinks freely first
        wait_for_thinking(reqs, reasoning, tm)
    if not req.separate_reasoning:  # the thinking stays in the content, as the model wrote it
        reasoning = None
    group = submit(request, reqs, stream=req.stream)
    cid, created = f"chatcmpl-{reqs[0].rid}", int(time.time())
    if not req.stream:
        states = await _finished(group, request, names)
        body = {
            "id": cid, "object": "chat.completion", "created": created, "model": served,
            "choices": [_chat_choice(s, req, tool_mode, tm.tokenizer, reasoning) for s in states],
            "usage": usage(states[:1], states), "system_fingerprint": None,
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = ids
        return JSONResponse(body)
    first = await first_event(group, request, names)
    return StreamingResponse(guarded_sse(chat_stream(group, first, req, tool_mode, cid, created, served,
                                                     tm.tokenizer, reasoning, ids)),
                             media_type="text/event-stream", headers=SSE_HEADERS)


def _prepare_chat(req: ChatCompletionRequest, tm, sanitize: bool) -> tuple[Any, list[int], dict[str, str]]:
    """(tool mode, prompt ids, constraint) of a chat request, on a tokenizer thread: the tools, the
    chat template and tokenization each walk the whole request, which may be large. `sanitize`:
    control-token text in the client's content is tokenized as text (chat_tokens.py)."""
    tool_mode = req.tool_mode()
    if tool_mode is not None:  # (tools, choice, the server's tool-call format)
        tool_mode = (*tool_mode, tm.tool_format)
    text = "".join(m.text() for m in req.messages)
    tm.builder.check_chars(text, "messages")  # hopelessly long: refused before rendering anything
    ids = chat_ids(req, tm.builder, tool_mode[0] if tool_mode else None, sanitize, tm.tool_format)
    room = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return tool_mode, req.truncated(ids, tm.builder.context_len, room), chat_constraint(req, tool_mode)


def _chat_choice(s: ReqState, req: ChatCompletionRequest, tool_mode, tokenizer,
                 reasoning: ReasoningFormat | None) -> dict[str, Any]:
    """A choice's message: the thinking split off by the reader that streams it (reasoning.py), its
    tool calls by the parser that streams them (tool_stream.py), so both answers agree byte for
    byte; legacy `functions` get `function_call` (the first call)."""
    text, thought, truncated = s.text, None, False
    if reasoning is not None:
        thought, text, truncated = split_thinking(s.text, reasoning)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or thought is None else None}
    if thought is not None and req.include_reasoning:
        message["reasoning_content"] = thought
    elif thought is not None:
        message["content"] = text
    finish = finish_reason(s.finish)
    if tool_mode is not None:
        content, calls = tool_stream.split(text, *tool_mode)
        if calls:
            message["content"] = content
            if req.legacy_functions:
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
            else:
                message["tool_calls"] = [c.to_openai() for c in calls]
        finish = tool_finish(finish, calls, req.legacy_functions)
    logprobs = None
    if req.logprobs:
        logprobs = {"content": chat_logprobs(logprob_names(tokenizer, req), s.output_logprobs, s.output_top_logprobs)}
    choice = {"index": s.index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    if req.return_token_ids:
        choice["token_ids"] = list(s.output_ids)
    if truncated and finish == "length":  # the budget ran out while the model was still thinking
        choice["reasoning_truncated"] = True
    return choice


# ----------------------------------------------------------------------- completions
@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    req = await read_model(request, CompletionRequest)
    tm, served = tm_of(request), request.app.state.served_model
    p = req.prompt
    tokenize = tm.builder.tokenize
    if isinstance(p, str):
        token_lists = [await off_loop(request, OPENAI_NAMES, tokenize, p)]
    elif not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif isinstance(p[0], str):
        check_count(request, len(p) * req.n, "prompt", OPENAI_NAMES)
        token_lists = await off_loop(request, OPENAI_NAMES, lambda: [tokenize(t) for t in p])
    elif isinstance(p[0], int):
        token_lists = [list(p)]
    else:
        token_lists = [list(ids) for ids in p]
    max_new = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    token_lists = [req.truncated(ids, tm.builder.context_len, max_new) for ids in token_lists]
    params = {**req.sampling_params(max_new), **format_constraint(req)}
    if req.logprobs is not None and not 0 <= req.logprobs <= 20:
        raise APIError(400, f"logprobs must be between 0 and 20, got {req.logprobs}", param="logprobs")
    want_lp = req.logprobs is not None
    names = _names(req)
    reqs = await _build(request, names, token_lists, params, want_lp, 0 if (want_lp and req.echo) else -1,
                        req.logprobs or 0, req.stream, req.rid)
    prompt_texts = [tm.tokenizer.decode(ids) for ids in token_lists] if req.echo else None
    group = submit(request, reqs, stream=req.stream)
    cid, created = f"cmpl-{reqs[0].rid}", int(time.time())
    if not req.stream:
        states = await _finished(group, request, names)
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": served,
            "choices": [_completion_choice(s, req, prompt_texts, tm.tokenizer, token_lists) for s in states],
            "usage": usage(states[::req.n], states), "system_fingerprint": None,
        })
    first = await first_event(group, request, names)
    return StreamingResponse(guarded_sse(completion_stream(group, first, req, prompt_texts, cid, created, served,
                                                           tm.tokenizer, token_lists)),
                             media_type="text/event-stream", headers=SSE_HEADERS)


def _completion_choice(s: ReqState, req: CompletionRequest, prompt_texts: list[str] | None, tokenizer,
                       token_lists: list[list[int]]) -> dict:
    prompt_text = prompt_texts[s.index // req.n] if prompt_texts else None
    choice = {
        "index": s.index, "text": (prompt_text or "") + s.text, "finish_reason": finish_reason(s.finish),
        "logprobs": completion_choice_logprobs(logprob_names(tokenizer, req), req, prompt_text, s.input_logprobs,
                                               s.output_logprobs, s.output_top_logprobs, s.input_top_logprobs),
    }
    if req.return_token_ids:
        choice.update(prompt_token_ids=token_lists[s.index // req.n], token_ids=list(s.output_ids))
    return choice
