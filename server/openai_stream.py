"""The SSE streams of /v1/chat/completions and /v1/completions (OpenAI chunk shapes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixlm.runtime.request.reasoning import ReasoningFormat
from radixlm.server import tool_stream
from radixlm.server.common import SSE_DONE, sse
from radixlm.server.errors import APIError
from radixlm.server.openai_convert import (
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    logprob_names,
    logprobs_end,
    usage,
)
from radixlm.server.openai_models import ChatCompletionRequest, CompletionRequest
from radixlm.server.reasoning import ThinkingSplit, with_calls
from radixlm.server.request_state import Group, ReqState


def error_event(state: ReqState) -> bytes:
    code = state.finish.code or 500
    return sse(APIError(code, f"generation aborted: {state.finish.message or 'no reason given'}").body())


def top_rows(rows: list | None) -> list:
    return [[[lp, tid, None] for lp, tid in row] for row in rows or []]


def chunk_usage(state: ReqState) -> dict[str, Any]:
    """One generation's usage so far (stream_options.continuous_usage_stats)."""
    prompt = state.last.prompt_tokens if state.last is not None else len(state.req.input_ids)
    completion = state.last.completion_tokens if state.last is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def chat_stream(group: Group, first, req: ChatCompletionRequest, tool_mode, cid: str, created: int,
                      model: str, tokenizer, reasoning: ReasoningFormat | None = None,
                      prompt_ids: list[int] | None = None) -> AsyncIterator[bytes]:
    """Content as it is decoded; a reasoning model's thinking as `reasoning_content` (reasoning.py);
    tool calls as they form (tool_stream.py): each call's id and name with empty arguments, then
    argument fragments, then the finish reason in an empty delta. With return_token_ids, a choice's
    first chunk carries the prompt's ids and each later one the ids its text came from."""
    def chunk(s: ReqState, delta: dict, lp: dict | None = None, finish: str | None = None,
              truncated: bool = False, ids: list[int] | None = None, prompt: bool = False) -> bytes:
        extra: dict = {"usage": chunk_usage(s)} if req.continuous_usage else {}
        if prompt and req.return_token_ids:
            extra["prompt_token_ids"] = prompt_ids
        choice = {"index": s.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if truncated:
            choice["reasoning_truncated"] = True
        if req.return_token_ids and not prompt:
            choice["token_ids"] = ids or []
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice], **extra})

    names = logprob_names(tokenizer, req)

    parsers: dict[int, tool_stream.CallParser | None] = {}
    thinking: dict[int, ThinkingSplit | None] = {}
    s, o = first
    try:
        while True:
            i = s.index
            if i not in parsers:
                parsers[i] = tool_stream.CallParser(*tool_mode) if tool_mode is not None else None
                thinking[i] = ThinkingSplit(reasoning, req.stream_reasoning) if reasoning is not None else None
                yield chunk(s, {"role": "assistant", "content": ""}, prompt=True)
            parser, split = parsers[i], thinking[i]
            deltas = with_calls(split.feed(o.text) if split is not None else [{"content": o.text}] if o.text else [],
                             parser)
            if not req.include_reasoning:
                deltas = _without_reasoning(deltas)
            lp = None
            if req.logprobs and o.output_logprobs:
                entries = [[a, b, None] for a, b in o.output_logprobs]
                lp = {"content": chat_logprobs(names, entries, top_rows(o.output_top_logprobs))}
            shaped = _shaped(deltas, req.legacy_functions)
            if not shaped and (lp is not None or (req.return_token_ids and o.new_ids)):
                shaped = [{"content": ""}]  # logprobs and ids of text held back (a stop string) still arrive
            for k, delta in enumerate(shaped):
                yield chunk(s, delta, lp if k == 0 else None, ids=o.new_ids if k == 0 else None)
            if o.finish is not None and o.finish.type == "abort":
                yield error_event(s)
            elif o.finish is not None:
                rest = with_calls(split.finish(), parser) if split is not None else []
                rest += parser.finish() if parser is not None else []
                if not req.include_reasoning:
                    rest = _without_reasoning(rest)
                for delta in _shaped(rest, req.legacy_functions):
                    yield chunk(s, delta)
                calls = parser.calls if parser is not None else []
                finish = tool_finish(finish_reason(o.finish), calls, req.legacy_functions)
                yield chunk(s, {}, finish=finish, truncated=split is not None and split.open and finish == "length")
            if group.done:
                break
            s, o = await group.next()
        if req.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(group.states[:1], group.states)})
        yield SSE_DONE
    finally:
        group.close()


def tool_finish(finish: str | None, calls: list, legacy: bool) -> str | None:
    """"tool_calls" ("function_call" for legacy functions) when an output that ended on its own
    made calls; a call cut short keeps "length"."""
    if calls and finish == "stop":
        return "function_call" if legacy else "tool_calls"
    return finish


def _without_reasoning(deltas: list[dict]) -> list[dict]:
    """The deltas less their thinking (vLLM's include_reasoning=false)."""
    kept = [{k: v for k, v in d.items() if k != "reasoning_content"} for d in deltas]
    return [d for d in kept if d]


def _shaped(deltas: list[dict], legacy: bool) -> list[dict]:
    if not legacy:
        return deltas
    return [d for d in map(tool_stream.legacy_delta, deltas) if d is not None]


def completion_choice_logprobs(tokenizer, req: CompletionRequest, prompt_text: str | None, inputs: list,
                               outputs: list, tops: list, input_tops: list | None = None,
                               text_offset: int | None = None) -> dict | None:
    """A completion choice's `logprobs`: with echo, the prompt's tokens first (their top-k rows from
    `input_tops`, as /generate's input_top_logprobs). `text_offset`: where this piece's text begins
    in the choice's text (a stream's later chunks); by default 0 with echo, else after the prompt."""
    if req.logprobs is None:
        return None
    entries = (inputs if req.echo else []) + outputs
    rows: list = []
    if req.echo:
        given = list(input_tops or [])
        rows = given[:len(inputs)] + [[]] * (len(inputs) - len(given))
    rows += list(tops) + [[]] * (len(outputs) - len(tops))
    offset = text_offset if text_offset is not None else 0 if req.echo else len(prompt_text or "")
    return completion_logprobs(tokenizer, entries, rows, offset)


async def completion_stream(group: Group, first, req: CompletionRequest, prompt_texts, cid: str, created: int,
                            model: str, tokenizer, token_lists: list[list[int]] | None = None) -> AsyncIterator[bytes]:
    """A chunk per output; with return_token_ids each carries its ids, a choice's first its prompt's too."""
    offsets: dict[int, int] = {}  # per choice: where its next chunk's tokens begin in its text
    names = logprob_names(tokenizer, req)
    s, o = first
    try:
        while True:
            text, inputs, input_tops, first_of_choice = o.text, [], None, s.index not in offsets
            if first_of_choice:
                offsets[s.index] = 0
                if prompt_texts:
                    text = prompt_texts[s.index // req.n] + text
                    inputs, input_tops = s.input_logprobs, s.input_top_logprobs
            outputs = [[a, b, None] for a, b in o.output_logprobs or []]
            tops = top_rows(o.output_top_logprobs)
            logprobs = completion_choice_logprobs(names, req, None, inputs, outputs, tops, input_tops,
                                                  offsets[s.index])
            if logprobs is not None:
                offsets[s.index] = logprobs_end(logprobs, offsets[s.index])
            if o.finish is not None and o.finish.type == "abort":
                yield error_event(s)
            elif (text or o.finish is not None or (logprobs and logprobs["tokens"])
                  or (req.return_token_ids and (o.new_ids or first_of_choice))):
                extra = {"usage": chunk_usage(s)} if req.continuous_usage else {}
                choice = {"index": s.index, "text": text, "logprobs": logprobs,
                          "finish_reason": finish_reason(o.finish)}
                if req.return_token_ids:
                    choice["token_ids"] = list(o.new_ids)
                    if first_of_choice and token_lists is not None:
                        choice["prompt_token_ids"] = token_lists[s.index // req.n]
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                           "choices": [choice], **extra})
            if group.done:
                break
            s, o = await group.next()
        if req.include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(group.states[::req.n], group.states)})
        yield SSE_DONE
    finally:
        group.close()
