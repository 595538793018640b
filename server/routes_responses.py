"""OpenAI's Responses API: `POST /v1/responses` (plain and streamed), `GET` and `DELETE
/v1/responses/{id}`.

A request becomes a chat request (responses_convert.py) and runs the chat path's steps: the chat
template with control-token text kept as text, the same tool and schema constraints, the radix
cache. Finished responses are kept in the server's bounded store (responses_store.py) unless
`store` is false; `previous_response_id` continues a stored conversation.

A stream is OpenAI's event sequence, each event with its `sequence_number`: response.created,
response.in_progress; for the text output_item.added, content_part.added, output_text.delta ...,
output_text.done, content_part.done, output_item.done; for each tool call output_item.added,
function_call_arguments.delta and .done, output_item.done; last response.completed (or
response.incomplete at max_output_tokens). Tool calls stream as they form (server/tool_stream.py,
the parser chat streams with): a call's item is added when its name is known and its arguments
arrive as fragments; the message item, if any, stays open beside the calls until the output ends.
Streamed and plain answers are the same parse of the same text, so their items are identical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response, StreamingResponse

from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.reasoning import ReasoningFormat
from radixlm.server import tool_calls, tool_stream
from radixlm.server.chat_tokens import chat_ids, sanitize_wanted
from radixlm.server.common import (
    SSE_HEADERS,
    ApiNames,
    api_error,
    build,
    finish_error,
    first_event,
    guarded_sse,
    raise_request_error,
    read_model,
    submit,
    tm_of,
)
from radixlm.server.errors import APIError, JSONResponse
from radixlm.server.openai_convert import chat_constraint, chat_logprobs
from radixlm.server.openai_models import ChatCompletionRequest
from radixlm.server.openai_stream import top_rows
from radixlm.server.reasoning import ThinkingSplit, thinking_format, wait_for_thinking, with_calls
from radixlm.server.reasoning import split as split_thinking
from radixlm.server.request_state import Group, ReqState
from radixlm.server.responses_convert import (
    ResponsesRequest,
    call_item,
    chat_request,
    item_dicts,
    message_item,
    new_id,
    output_items,
    parse_items,
    reasoning_item,
    response_object,
    status_of,
    text_part,
    usage,
)
from radixlm.server.responses_store import Conversation, ResponseStore

router = APIRouter()


def store_of(app: FastAPI) -> ResponseStore:
    """The app's response store, made on first use (one per server)."""
    if getattr(app.state, "responses", None) is None:
        app.state.responses = ResponseStore()
    return app.state.responses


@dataclass(slots=True)
class Turn:
    """One POST /v1/responses: what was asked, the conversation it continues, where it is kept."""

    id: str
    created: int
    req: ResponsesRequest
    chat: ChatCompletionRequest
    tool_mode: tuple[list[dict], str | dict] | None
    model: str
    conversation: Conversation  # before the answer: the stored chain's items, then this input
    store: ResponseStore
    msg_id: str
    stored: bool  # kept for previous_response_id and GET (the request asked, and it fits the store)
    reasoning: ReasoningFormat | None = None  # the thinking is split off into a reasoning item

    def response(self, status: str, output: list[dict], used: dict | None) -> dict[str, Any]:
        return response_object(self.id, self.created, self.req, self.model, status, output, used, self.stored)

    def finish(self, state: ReqState, output: list[dict]) -> dict[str, Any]:
        """The final Response object, stored unless the request said store: false (or it was
        deleted meanwhile); one that turned out too large for the store says so."""
        final = self.response(status_of(state), output, usage(state))
        kept = [item for item in output if item["type"] != "reasoning"]  # nothing of it reaches the model again
        if self.stored and not self.store.put(final, self.conversation.extend(kept)):
            final["store"] = False
        return final

    def split(self, text: str) -> tuple[str | None, str | None, list[tool_calls.ToolCall]]:
        """(thinking, text, calls) of a finished output: what streaming it delivers."""
        thought = None
        if self.reasoning is not None:
            thought, text, _ = split_thinking(text, self.reasoning)
        answer, calls = tool_stream.split(text, *self.tool_mode) if self.tool_mode is not None else (text, [])
        return thought, answer, calls


@dataclass(slots=True)
class _Prepared:
    chat: ChatCompletionRequest
    tool_mode: tuple[list[dict], str | dict] | None
    names: ApiNames
    ids: list[int]
    constraint: dict[str, str]
    conversation: Conversation


def _prepare(req: ResponsesRequest, history: Conversation, tm, sanitize: bool) -> _Prepared:
    """The stored conversation decoded, this input added, the chat request it means, its prompt ids
    and constraint (on a tokenizer thread: each step walks the whole conversation)."""
    chat = chat_request(req, parse_items(history.decode()) + req.input_items())
    tool_mode = chat.tool_mode()
    if tool_mode is not None:  # (tools, choice, the server's tool-call format)
        tool_mode = (*tool_mode, tm.tool_format)
    names = req.api_names(tool_mode)
    try:
        tm.builder.check_chars("".join(m.text() for m in chat.messages), "input")
        ids = chat_ids(chat, tm.builder, tool_mode[0] if tool_mode else None, sanitize, tm.tool_format)
    except RequestError as e:
        raise api_error(e, names) from e
    constraint = chat_constraint(chat, tool_mode, lambda i: f"tools.{i}.parameters")
    return _Prepared(chat, tool_mode, names, ids, constraint, history.extend(item_dicts(req.input_items())))


def _history(store: ResponseStore, req: ResponsesRequest, limit: int) -> Conversation:
    """The stored conversation `previous_response_id` continues, refused before anything of it is
    decoded when it is larger than a request body may be (max_request_bytes): what a request pulls
    from the store is bounded as what it sends is."""
    if req.previous_response_id is None:
        return Conversation()
    previous = store.get(req.previous_response_id)
    if previous is None:
        raise APIError(400, f"Previous response with id '{req.previous_response_id[:200]}' not found.",
                       param="previous_response_id", code="previous_response_not_found")
    size = previous.conversation.size
    if size > limit:
        raise APIError(400, f"the conversation of previous_response_id is {size} bytes, more than a request may bring "
                            f"in ({limit}, max_request_bytes); send the items it needs as input instead",
                       param="previous_response_id", code="conversation_too_large")
    return previous.conversation


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    req = await read_model(request, ResponsesRequest)
    tm, store = tm_of(request), store_of(request.app)
    history = _history(store, req, tm.args.max_request_bytes)
    sanitize = sanitize_wanted(None, tm.args.allow_control_tokens_in_content)
    size = getattr(request.state, "body_bytes", 0) + history.size
    p = await tm.run_blocking(size, _prepare, req, history, tm, sanitize)
    max_new = p.chat.max_tokens
    if max_new is None:  # the room left, capped by --default-max-tokens, as chat does
        max_new = tm.builder.default_max_new_tokens(len(p.ids), tm.args.default_max_tokens)
    params = {**p.chat.sampling_params(max_new), **p.constraint}
    rid, stream = new_id("resp"), bool(req.stream)
    groups, _ = await build(request, p.names, None, [p.ids], params, p.chat.logprobs, -1, p.chat.top_logprobs or 0,
                            stream, rid)
    reasoning = thinking_format(p.chat, tm)
    if p.constraint:  # the format or tool grammar judges the answer, after the thinking
        wait_for_thinking(groups[0], reasoning, tm)
    if not p.chat.separate_reasoning:
        reasoning = None
    group = submit(request, groups[0], stream=stream)
    stored = req.store is not False and store.fits(p.conversation)
    turn = Turn(rid, int(time.time()), req, p.chat, p.tool_mode, request.app.state.served_model, p.conversation,
                store, new_id("msg"), stored, reasoning)
    if stored:
        store.begin(rid)  # a DELETE from now on means: do not store it
    streaming = False
    try:
        if not stream:
            (state,) = await group.results(request)
            raise_request_error(state, p.names, any_abort=True)
            thought, text, calls = turn.split(state.text)
            logprobs = chat_logprobs(tm.tokenizer, state.output_logprobs, state.output_top_logprobs) \
                if p.chat.logprobs else None
            output = output_items(turn.msg_id, text, calls, status_of(state), logprobs)
            if thought is not None:
                output.insert(0, reasoning_item(new_id("rs"), thought))
            return JSONResponse(turn.finish(state, output))
        first = await first_event(group, request, p.names)
        streaming = True
    finally:
        if not streaming:  # else the stream ends it
            store.end(rid)
    return StreamingResponse(guarded_sse(_events(group, first, turn, tm.tokenizer)),
                             media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    stored = store_of(request.app).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return Response(stored.response, media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    if not store_of(request.app).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id[:200]}' not found.", param="response_id")


# ----------------------------------------------------------------------- streaming
class _Writer:
    """Numbers the events of one stream and keeps the message item open while text arrives."""

    def __init__(self, msg_id: str):
        self.seq = 0
        self.msg_id = msg_id
        self.opened = False
        self.text: list[str] = []
        self.logprobs: list[dict] = []
        self.items = 0  # output items added so far
        self.msg_index = 0  # the message's output_index, once opened
        self.call_index: dict[int, int] = {}  # a call's index among the calls -> its output_index
        self.thought: list[str] = []  # the reasoning item's text so far (opened with its first delta)
        self.rs_id, self.rs_index = new_id("rs"), 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.msg_id, "output_index": self.msg_index, "content_index": 0}

    def open(self) -> list[bytes]:
        if self.opened:
            return []
        self.opened, self.msg_index = True, self.items
        self.items += 1
        item = {**message_item(self.msg_id, "", "in_progress"), "content": []}
        return [self("response.output_item.added", output_index=self.msg_index, item=item),
                self("response.content_part.added", part=text_part(""), **self._where())]

    def delta(self, text: str, logprobs: list[dict]) -> list[bytes]:
        self.text.append(text)
        self.logprobs += logprobs
        return self.open() + [self("response.output_text.delta", delta=text, logprobs=logprobs, **self._where())]

    def close(self, status: str) -> tuple[dict, list[bytes]]:
        """The finished message item and its closing events (opening it first if nothing came)."""
        events = self.open()
        item = message_item(self.msg_id, "".join(self.text), status, self.logprobs)
        part = item["content"][0]
        events += [self("response.output_text.done", text=part["text"], logprobs=part["logprobs"], **self._where()),
                   self("response.content_part.done", part=part, **self._where()),
                   self("response.output_item.done", output_index=self.msg_index, item=item)]
        return item, events

    def reasoning_delta(self, text: str) -> list[bytes]:
        events = []
        if not self.thought:
            self.rs_index, self.items = self.items, self.items + 1
            events.append(self("response.output_item.added", output_index=self.rs_index,
                               item={**reasoning_item(self.rs_id, "", "in_progress"), "content": []}))
        self.thought.append(text)
        where = {"item_id": self.rs_id, "output_index": self.rs_index, "content_index": 0}
        return events + [self("response.reasoning_text.delta", delta=text, **where)]

    def reasoning_done(self) -> tuple[int, dict, list[bytes]] | None:
        if not self.thought:
            return None
        item = reasoning_item(self.rs_id, "".join(self.thought))
        where = {"item_id": self.rs_id, "output_index": self.rs_index, "content_index": 0}
        return self.rs_index, item, [self("response.reasoning_text.done", text=item["content"][0]["text"], **where),
                                     self("response.output_item.done", output_index=self.rs_index, item=item)]

    def tool_delta(self, delta: dict, calls: list[tool_calls.ToolCall]) -> list[bytes]:
        """A tool_calls delta of tool_stream.CallParser: a call's item opens, or its arguments grow."""
        events = []
        for part in delta["tool_calls"]:
            k = part["index"]
            if k not in self.call_index:
                self.call_index[k], self.items = self.items, self.items + 1
                item = {**call_item(calls[k], "in_progress"), "arguments": ""}
                events.append(self("response.output_item.added", output_index=self.call_index[k], item=item))
            fragment = part["function"].get("arguments", "")
            if fragment:
                events.append(self("response.function_call_arguments.delta", delta=fragment,
                                   item_id=call_item(calls[k])["id"], output_index=self.call_index[k]))
        return events

    def call_done(self, k: int, call: tool_calls.ToolCall) -> tuple[int, dict, list[bytes]]:
        item = call_item(call)
        index = self.call_index[k]
        where = {"item_id": item["id"], "output_index": index}
        return index, item, [self("response.function_call_arguments.done", arguments=call.arguments, **where),
                             self("response.output_item.done", output_index=index, item=item)]


def _apply(write: _Writer, deltas: list[dict], parser: tool_stream.CallParser | None,
           logprobs: list[dict]) -> list[bytes]:
    events = []
    for d in deltas:
        if "reasoning_content" in d:
            events += write.reasoning_delta(d["reasoning_content"])
        elif "tool_calls" in d and parser is not None:
            events += write.tool_delta(d, parser.calls)
        elif d.get("content") or logprobs:
            events += write.delta(d.get("content", ""), logprobs)
            logprobs = []
    return events


async def _events(group: Group, first, turn: Turn, tokenizer):
    write = _Writer(turn.msg_id)
    pending = turn.response("in_progress", [], None)
    yield write("response.created", response=pending)
    yield write("response.in_progress", response=pending)
    parser = tool_stream.CallParser(*turn.tool_mode) if turn.tool_mode is not None else None
    split = ThinkingSplit(turn.reasoning) if turn.reasoning is not None else None
    s, o = first
    try:
        while True:
            deltas = with_calls(split.feed(o.text) if split is not None else [{"content": o.text}], parser)
            logprobs = []
            if turn.chat.logprobs and o.output_logprobs and parser is None:
                entries = [[lp, tid, None] for lp, tid in o.output_logprobs]
                logprobs = chat_logprobs(tokenizer, entries, top_rows(o.output_top_logprobs))
            for event in _apply(write, deltas, parser, logprobs):
                yield event
            if o.finish is not None:
                break
            s, o = await group.next()
        if o.finish.type == "abort":
            error = finish_error(o.finish)
            yield write("error", code="server_error", message=error.message, param=None)
            failed = {**turn.response("failed", [], None),
                      "error": {"code": "server_error", "message": error.message}}
            yield write("response.failed", response=failed)
            return
        rest = with_calls(split.finish(), parser) if split is not None else []
        rest += parser.finish() if parser is not None else []
        for event in _apply(write, rest, parser, []):
            yield event
        calls = [] if parser is None else parser.calls
        status, placed = status_of(s), []
        if (thought := write.reasoning_done()) is not None:
            index, item, events = thought
            placed.append((index, item))
            for event in events:
                yield event
        if write.opened or not calls:
            item, events = write.close(status)
            placed.append((write.msg_index, item))
            for event in events:
                yield event
        for k, call in enumerate(calls):
            index, item, events = write.call_done(k, call)
            placed.append((index, item))
            for event in events:
                yield event
        output = [item for _, item in sorted(placed, key=lambda x: x[0])]
        final = turn.finish(s, output)
        yield write("response.completed" if final["status"] == "completed" else "response.incomplete",
                    response=final)
    finally:
        group.close()
        turn.store.end(turn.id)
