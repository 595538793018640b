"""POST /v1/chat/completions and POST /v1/completions (OpenAI-compatible, SSE streaming)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from radixlm.runtime.core import Req
from radixlm.server import tool_calls
from radixlm.server.app import SSE_DONE, SSE_HEADERS, check_budget, first_event, raise_request_error, read_json, sse
from radixlm.server.errors import APIError, JSONResponse, bad_request
from radixlm.server.openai_api import (
    RENAMES,
    ChatCompletionRequest,
    CompletionRequest,
    chat_constraint,
    chat_logprobs,
    chat_prompt,
    completion_logprobs,
    finish_reason,
    parse_request,
    usage,
)
from radixlm.server.tokenizer_manager import Group, ReqState, TokenizerManager

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _raise_if_aborted(state: ReqState) -> None:
    raise_request_error(state)
    if state.finish is not None and state.finish.type == "abort":
        raise APIError(500, f"generation aborted: {state.finish.message or 'no reason given'}")


def _error_event(state: ReqState) -> bytes:
    code = state.finish.code or 500
    return sse(APIError(code, f"generation aborted: {state.finish.message or 'no reason given'}").body())


def _top_rows(rows: list | None) -> list:
    return [[[lp, tid, None] for lp, tid in row] for row in rows or []]


def add_openai_routes(app: FastAPI, tm: TokenizerManager, served_model: str) -> None:
    args = tm.args
    tokenizer = tm.tokenizer

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served_model!r}",
                           param="model", code="model_not_found")

    def build(token_lists: list[list[int]], params: dict, logprob: bool, start: int, top: int, stream: bool,
              rid: str | None) -> list[Req]:
        try:
            built = tm.builder.build(None, token_lists, params, logprob, start, top, stream, rid)
        except ValueError as e:
            raise bad_request(e, RENAMES) from e
        reqs = [r for group in built.groups for r, _ in group]
        check_budget(tm, reqs, "max_tokens")
        return reqs

    def tokenize(text: str) -> list[int]:
        try:
            return tm.builder.tokenize(text)
        except ValueError as e:
            raise bad_request(e) from e

    # --------------------------------------------------------------- chat
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await read_json(request, args.max_request_bytes))
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        tool_mode = req.tool_mode()
        prompt = chat_prompt(req, tokenizer, tool_mode[0] if tool_mode else None)
        ids = tokenize(prompt)
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_new is None:
            max_new = max(tm.context_len - len(ids), 1)
        params = {**req.sampling_params(max_new), **chat_constraint(req, tool_mode)}
        reqs = build([ids], params, req.logprobs, -1, req.top_logprobs or 0, req.stream, req.rid)
        group = app.state.submit(request, reqs, stream=req.stream)
        cid, created = f"chatcmpl-{reqs[0].rid}", int(time.time())
        if not req.stream:
            states = await group.results(request)
            for s in states:
                _raise_if_aborted(s)
            return JSONResponse({
                "id": cid, "object": "chat.completion", "created": created, "model": served_model,
                "choices": [_chat_choice(s, req, tool_mode) for s in states],
                "usage": usage(states[:1], states), "system_fingerprint": None,
            })
        first = await first_event(group, request)
        raise_request_error(first[0])
        return StreamingResponse(_chat_stream(group, first, req, tool_mode, cid, created),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    def _chat_choice(s: ReqState, req: ChatCompletionRequest, tool_mode) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": s.text}
        finish = finish_reason(s.finish)
        if tool_mode is not None:
            content, calls = tool_calls.parse(s.text, *tool_mode)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
                finish = "tool_calls"
        logprobs = None
        if req.logprobs:
            logprobs = {"content": chat_logprobs(tokenizer, s.output_logprobs, s.output_top_logprobs)}
        return {"index": s.index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    async def _chat_stream(group: Group, first, req: ChatCompletionRequest, tool_mode, cid: str,
                           created: int) -> AsyncIterator[bytes]:
        def chunk(choices: list, extra: dict | None = None) -> bytes:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": served_model,
                        "choices": choices, **(extra or {})})

        filters: dict[int, tool_calls.StreamFilter] = {}
        s, o = first
        try:
            while True:
                i = s.index
                if i not in filters:
                    filters[i] = tool_calls.StreamFilter(tool_mode[0] if tool_mode else [])
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                text = o.text
                if tool_mode is not None:  # "auto" streams the text around calls; forced calls come at the end
                    text = filters[i].feed(text) if tool_mode[1] == "auto" else ""
                lp = None
                if req.logprobs and o.output_logprobs:
                    entries = [[a, b, None] for a, b in o.output_logprobs]
                    lp = {"content": chat_logprobs(tokenizer, entries, _top_rows(o.output_top_logprobs))}
                if text or lp:
                    yield chunk([{"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}])
                if o.finish is not None and o.finish.type == "abort":
                    yield _error_event(s)
                elif o.finish is not None:
                    delta: dict[str, Any] = {}
                    finish = finish_reason(o.finish)
                    if tool_mode is not None:
                        if tool_mode[1] == "auto":
                            rest, calls = filters[i].finish()
                        else:
                            content, calls = tool_calls.parse(s.text, *tool_mode)
                            rest = content or ""
                        if rest:
                            delta["content"] = rest
                        if calls:
                            delta["tool_calls"] = [c.to_openai(k) for k, c in enumerate(calls)]
                            finish = "tool_calls"
                    yield chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}])
                if group.done:
                    break
                s, o = await group.next()
            if req.include_usage:
                yield chunk([], {"usage": usage(group.states[:1], group.states)})
            yield SSE_DONE
        finally:
            group.close()

    # --------------------------------------------------------------- completions
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await read_json(request, args.max_request_bytes))
        check_model(req.model)
        p = req.prompt
        if isinstance(p, str):
            token_lists = [tokenize(p)]
        elif not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        elif isinstance(p[0], str):
            token_lists = [tokenize(t) for t in p]
        elif isinstance(p[0], int):
            token_lists = [list(p)]
        else:
            token_lists = [list(ids) for ids in p]
        max_new = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
        params = req.sampling_params(max_new)
        if req.json_schema is not None:
            params["json_schema"] = req.json_schema
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be between 0 and 20, got {req.logprobs}", param="logprobs")
        want_lp = req.logprobs is not None
        reqs = build(token_lists, params, want_lp, 0 if (want_lp and req.echo) else -1, req.logprobs or 0,
                     req.stream, req.rid)
        prompt_texts = [tokenizer.decode(ids) for ids in token_lists] if req.echo else None
        group = app.state.submit(request, reqs, stream=req.stream)
        cid, created = f"cmpl-{reqs[0].rid}", int(time.time())
        if not req.stream:
            states = await group.results(request)
            for s in states:
                _raise_if_aborted(s)
            return JSONResponse({
                "id": cid, "object": "text_completion", "created": created, "model": served_model,
                "choices": [_completion_choice(s, req, prompt_texts) for s in states],
                "usage": usage(states[::req.n], states), "system_fingerprint": None,
            })
        first = await first_event(group, request)
        raise_request_error(first[0])
        return StreamingResponse(_completion_stream(group, first, req, prompt_texts, cid, created),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    def _completion_logprobs(s: ReqState, req: CompletionRequest, prompt_text: str | None, inputs: list,
                             outputs: list, tops: list) -> dict | None:
        if req.logprobs is None:
            return None
        entries = (inputs if req.echo else []) + outputs
        rows = ([None] * len(inputs) if req.echo else []) + tops
        offset = 0 if req.echo else len(prompt_text or "")
        return completion_logprobs(tokenizer, entries, rows, offset)

    def _completion_choice(s: ReqState, req: CompletionRequest, prompt_texts: list[str] | None) -> dict:
        prompt_text = prompt_texts[s.index // req.n] if prompt_texts else None
        return {
            "index": s.index, "text": (prompt_text or "") + s.text, "finish_reason": finish_reason(s.finish),
            "logprobs": _completion_logprobs(s, req, prompt_text, s.input_logprobs, s.output_logprobs,
                                             s.output_top_logprobs),
        }

    async def _completion_stream(group: Group, first, req: CompletionRequest, prompt_texts, cid: str,
                                 created: int) -> AsyncIterator[bytes]:
        started: set[int] = set()
        s, o = first
        try:
            while True:
                text, inputs = o.text, []
                if s.index not in started:
                    started.add(s.index)
                    if prompt_texts:
                        text = prompt_texts[s.index // req.n] + text
                        inputs = s.input_logprobs
                outputs = [[a, b, None] for a, b in o.output_logprobs or []]
                logprobs = _completion_logprobs(s, req, None, inputs, outputs, _top_rows(o.output_top_logprobs))
                if o.finish is not None and o.finish.type == "abort":
                    yield _error_event(s)
                elif text or o.finish is not None or (logprobs and logprobs["tokens"]):
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": served_model,
                               "choices": [{"index": s.index, "text": text, "logprobs": logprobs,
                                            "finish_reason": finish_reason(o.finish)}]})
                if group.done:
                    break
                s, o = await group.next()
            if req.include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": served_model,
                           "choices": [], "usage": usage(group.states[::req.n], group.states)})
            yield SSE_DONE
        finally:
            group.close()
