"""OpenAI's Responses API over the chat path: the request model, a Responses request (and the
conversation before it) -> a ChatCompletionRequest, and the chat result -> Response objects.

Mapping: `instructions` -> a system message (not carried over by `previous_response_id`, as
OpenAI documents); `input` text -> a user message; message items -> messages (developer ->
system); `function_call` items -> an assistant message's tool_calls; `function_call_output` -> a
tool message; reasoning items are dropped (this server makes none). Function tools, tool_choice
and `text.format` become chat tools and response_format, so tools and constraints behave exactly
as on /v1/chat/completions, with one rule where chat refuses the pair: a forced tool call
(`required` or a named function) wins over `text.format`, and a JSON `text.format` wins over
`auto` tools (the answer follows the schema; force a call to get one).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from radixlm.server.common import ApiNames
from radixlm.server.errors import APIError
from radixlm.server.openai_models import (  # the chat models' base: strict values, known names accepted
    ChatCompletionRequest,
    FunctionDef,
    ReasoningEffort,
    RequestModel,
    check_unique_names,
)
from radixlm.server.request_state import ReqState
from radixlm.server.tool_calls import ToolCall, schema_owner

LOGPROBS = "message.output_text.logprobs"  # the one `include` value that changes this server's answer
INCLUDES = frozenset({  # every value OpenAI's `include` takes (the others name outputs this server never makes)
    LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs"})
MAX_METADATA = (16, 64, 512)  # OpenAI's bounds: pairs, key characters, value characters


def _text_or_list(value: Any) -> str:
    return "Text" if isinstance(value, str) else "List"


# ----------------------------------------------------------------------- input items
class TextPart(RequestModel):
    type: Literal["input_text", "output_text", "refusal"]  # images, files and audio need a model this is not
    text: str | None = None
    refusal: str | None = None
    IGNORED = frozenset({"annotations", "logprobs", "prompt_cache_breakpoint"})


_Content = Annotated[Annotated[str, Tag("Text")] | Annotated[list[TextPart], Tag("List")],
                     Discriminator(_text_or_list)]


def _joined(content: str | list[TextPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text or p.refusal or "" for p in content)


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: _Content
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    IGNORED = frozenset({"phase"})


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    IGNORED = frozenset({"caller", "namespace", "async"})


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str
    output: _Content
    name: str | None = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    IGNORED = frozenset({"caller", "namespace"})


class ReasoningItem(RequestModel):
    """A reasoning model's item sent back: accepted and dropped (nothing of it reaches this model)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message" if "role" in value else None)
    if not isinstance(kind, str):
        return None
    return {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
            "reasoning": "Reasoning"}.get(kind)


_ITEM_KINDS = "message, function_call, function_call_output or reasoning"
InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")] | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message=f"an input item's type must be {_ITEM_KINDS} (hosted tools' items and "
                                       "item_reference are not served: send the items themselves)"),
]


# ----------------------------------------------------------------------- tools and formats
class FunctionTool(FunctionDef):  # the chat tool's function, flat, with its type
    type: Literal["function"]
    IGNORED = frozenset({"defer_loading", "allowed_callers", "output_schema"})

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise PydanticCustomError("tool_type", "only function tools are served here, not '{kind}' (hosted tools "
                                      "need OpenAI's servers)", {"kind": str(data.get("type"))[:40]})
        return data


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no effect on this server's answer


class Reasoning(RequestModel):
    effort: ReasoningEffort | None = None  # the chat template's thinking switch, as chat's reasoning_effort
    summary: str | None = None
    generate_summary: str | None = None


# ----------------------------------------------------------------------- the request
class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Annotated[Annotated[str, Tag("Text")] | Annotated[list[InputItem], Tag("List")],
                     Discriminator(_text_or_list)] = []
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: Reasoning | None = None
    truncation: Literal["auto", "disabled"] | None = None  # an input too long for the context is a 400 either way
    metadata: dict[str, str] | None = None
    user: str | None = None
    # SGLang's and vLLM's sampling extensions of this route
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    IGNORED = frozenset({
        "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
        "stream_options", "context_management", "access_programs", "image", "background_options", "max_tool_calls",
        "request_id", "priority", "extra_key", "cache_salt", "session_id", "ngram_corpus_id", "mm_processor_kwargs",
        "enable_response_messages"})
    UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,), "moderation": (None,),
                   "previous_input_messages": (None,), "structured_outputs": (None,)}
    COUNTED = ("input", "tools", "include")

    @model_validator(mode="after")
    def _check_include_and_tools(self) -> ResponsesRequest:
        for i, value in enumerate(self.include or []):
            if value not in INCLUDES:
                raise APIError(400, f"include has {value[:80]!r}, which is not a value OpenAI's Responses API "
                                    f"defines ({', '.join(sorted(INCLUDES))})", param=f"include.{i}")
        check_unique_names([t.name for t in self.tools or []], "tools", "{}.name")
        return self

    @model_validator(mode="after")
    def _check_metadata(self) -> ResponsesRequest:
        pairs, key_chars, value_chars = MAX_METADATA
        meta = self.metadata or {}
        if len(meta) > pairs or any(len(k) > key_chars or len(v) > value_chars for k, v in meta.items()):
            raise APIError(400, f"metadata holds at most {pairs} pairs, keys of at most {key_chars} characters and "
                                f"values of at most {value_chars}", param="metadata")
        return self

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def format(self) -> TextFormat | None:
        fmt = self.text.format if self.text is not None else None
        return None if fmt is None or fmt.type == "text" else fmt

    def forced_tool(self) -> bool:
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, FunctionChoice))

    def api_names(self, tool_mode: tuple[list[dict], str | dict] | None) -> ApiNames:
        """How this request spells the runtime's fields in its errors (a schema that does not compile
        is text.format's, or the parameters of the tool (or tools) `tool_mode` constrains)."""
        tools_field = "tools"
        if tool_mode is not None:
            index = schema_owner(*tool_mode)
            tools_field = "tools" if index is None else f"tools.{index}.parameters"
        owner = tools_field if self.forced_tool() or not self.format else "text.format.schema"
        return ApiNames({"max_new_tokens": "max_output_tokens", "sampling_seed": "seed", "input_ids": "input",
                         "top_logprobs_num": "top_logprobs", "return_logprob": "include",
                         "json_schema": owner, "structural_tag": tools_field}, False)


def parse_items(items: list[dict[str, Any]]) -> list[Any]:
    """Stored conversation items (dicts this module wrote, any number of them) as item models again."""
    return ResponsesRequest.model_validate({"input": items}).input_items()


def item_dicts(items: list[Any]) -> list[dict[str, Any]]:
    """Items as the store keeps them: reasoning items are left out (nothing of them reaches this
    model, and their encrypted payloads would make every later turn carry them)."""
    return [item.model_dump(by_alias=True, exclude_none=True) for item in items if not isinstance(item, ReasoningItem)]


# ----------------------------------------------------------------------- -> the chat request
def _add_message(messages: list[dict], item: MessageItem) -> None:
    messages.append({"role": item.role, "content": _joined(item.content)})


def _add_call(messages: list[dict], item: FunctionCallItem) -> None:
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":  # parallel calls (and text before them): one turn
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _add_output(messages: list[dict], item: FunctionCallOutputItem) -> None:
    tool = {"role": "tool", "tool_call_id": item.call_id, "content": _joined(item.output)}
    messages.append(tool if item.name is None else {**tool, "name": item.name})


_TO_CHAT: dict[type, Callable[[list[dict], Any], None]] = {
    MessageItem: _add_message, FunctionCallItem: _add_call, FunctionCallOutputItem: _add_output,
    ReasoningItem: lambda messages, item: None}


def chat_request(req: ResponsesRequest, items: list[Any]) -> ChatCompletionRequest:
    """The chat request this Responses request means, over the whole conversation `items`."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in items:
        _TO_CHAT[type(item)](messages, item)
    if not messages:
        raise APIError(400, "input is empty: give text or items for the model to respond to", param="input")
    body: dict[str, Any] = {"messages": messages}
    for name in ("temperature", "top_p", "parallel_tool_calls", "top_k", "min_p", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "stop", "seed", "logit_bias", "chat_template_kwargs"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if LOGPROBS in (req.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    fmt = req.format
    if fmt is not None and not req.forced_tool():
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format.schema is required when type is 'json_schema'", param="text.format.schema")
        body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else
                                   {"type": "json_schema", "json_schema": {"name": fmt.name or "output",
                                                                           "schema": fmt.schema_}})
        choice = "none" if req.tools else choice  # the schema answers; auto tools would conflict with it
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    chat = ChatCompletionRequest.model_validate(body)
    chat.tool_mode()  # a 400 now for tool_choice without tools or naming a tool not given
    return chat


# ----------------------------------------------------------------------- -> Response objects
def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "status": status,
            "call_id": call.id, "name": call.name, "arguments": call.arguments}


def text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(msg_id: str, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking (--reasoning-parser), as OpenAI's reasoning item carries it."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(msg_id: str, text: str | None, calls: list[ToolCall], status: str,
                 logprobs: list | None = None) -> list[dict[str, Any]]:
    """A message (unless the output is tool calls only), then one function_call item per call."""
    out = [message_item(msg_id, text or "", status, logprobs)] if text or not calls else []
    return out + [call_item(c) for c in calls]


def usage(state: ReqState) -> dict[str, Any]:
    last = state.last
    assert last is not None, "usage of a finished generation"
    return {"input_tokens": last.prompt_tokens, "output_tokens": last.completion_tokens,
            "total_tokens": last.prompt_tokens + last.completion_tokens,
            "input_tokens_details": {"cached_tokens": last.cached_tokens,
                                     "cache_write_tokens": last.prompt_tokens - last.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


def status_of(state: ReqState) -> str:
    return "incomplete" if state.finish is not None and state.finish.type == "length" else "completed"


def response_object(rid: str, created: int, req: ResponsesRequest, model: str, status: str,
                    output: list[dict[str, Any]], used: dict[str, Any] | None, stored: bool) -> dict[str, Any]:
    """The Response object: what was asked (echoed as OpenAI does) and what came of it; `stored`:
    whether it is kept for previous_response_id and GET."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice or "auto"
    reasoning = req.reasoning or Reasoning()
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "background": False,
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
        "model": model, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary}, "service_tier": "default",
        "store": stored, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                 "verbosity": req.text.verbosity if req.text and req.text.verbosity else "medium"},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump() for t in req.tools or []],
        "top_logprobs": req.top_logprobs or 0, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled", "usage": used, "user": req.user, "metadata": req.metadata or {},
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
    }

