"""The SSE streams of /v1/chat/completions and /v1/completions (OpenAI chunk shapes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixlm.server import tool_calls
from radixlm.server.common import SSE_DONE, sse
from radixlm.server.errors import APIError
from radixlm.server.openai_convert import chat_logprobs, completion_logprobs, finish_reason, usage
from radixlm.server.openai_models import ChatCompletionRequest, CompletionRequest
from radixlm.server.request_state import Group, ReqState


def error_event(state: ReqState) -> bytes:
    code = state.finish.code or 500
    return sse(APIError(code, f"generation aborted: {state.finish.message or 'no reason given'}").body())


def top_rows(rows: list | None) -> list:
    return [[[lp, tid, None] for lp, tid in row] for row in rows or []]


async def chat_stream(group: Group, first, req: ChatCompletionRequest, tool_mode, cid: str, created: int,
                      model: str, tokenizer) -> AsyncIterator[bytes]:
    def chunk(choices: list, extra: dict | None = None) -> bytes:
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
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
                lp = {"content": chat_logprobs(tokenizer, entries, top_rows(o.output_top_logprobs))}
            if text or lp:
                yield chunk([{"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}])
            if o.finish is not None and o.finish.type == "abort":
                yield error_event(s)
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


def completion_choice_logprobs(tokenizer, req: CompletionRequest, prompt_text: str | None, inputs: list,
                               outputs: list, tops: list) -> dict | None:
    if req.logprobs is None:
        return None
    entries = (inputs if req.echo else []) + outputs
    rows = ([None] * len(inputs) if req.echo else []) + tops
    offset = 0 if req.echo else len(prompt_text or "")
    return completion_logprobs(tokenizer, entries, rows, offset)


async def completion_stream(group: Group, first, req: CompletionRequest, prompt_texts, cid: str, created: int,
                            model: str, tokenizer) -> AsyncIterator[bytes]:
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
            tops = top_rows(o.output_top_logprobs)
            logprobs = completion_choice_logprobs(tokenizer, req, None, inputs, outputs, tops)
            if o.finish is not None and o.finish.type == "abort":
                yield error_event(s)
            elif text or o.finish is not None or (logprobs and logprobs["tokens"]):
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": s.index, "text": text, "logprobs": logprobs,
                                        "finish_reason": finish_reason(o.finish)}]})
            if group.done:
                break
            s, o = await group.next()
        if req.include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(group.states[::req.n], group.states)})
        yield SSE_DONE
    finally:
        group.close()
