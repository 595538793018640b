"""OpenAI request models (pydantic, strict: a mistyped or unknown field is a 400 naming it) and the
conversions between them and the runtime: messages -> prompt, fields -> sampling params, token
logprobs -> OpenAI's two logprob shapes, usage."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from radixlm.server import tool_calls
from radixlm.server.errors import APIError

# SamplingParams' names -> the OpenAI names, for error messages
RENAMES = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "top_logprobs_num": "top_logprobs"}
ANY_JSON_OBJECT = "$$ANY$$"  # radixlm.constrained's "any JSON object" spec (no import: keep xgrammar lazy)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ----------------------------------------------------------------------- chat messages and tools
class FunctionDef(_Model):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Model):
    name: str
    arguments: str


class MessageToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class JsonSchemaFormat(_Model):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Model):
    include_usage: bool = False


# ----------------------------------------------------------------------- requests
class _Common(_Model):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    rid: str | None = None

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": self.n, "sampling_seed": self.seed}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                     "no_stop_trim", "regex", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    json_schema: dict[str, Any] | str | None = None  # SGLang extension

    def tool_mode(self) -> tuple[list[dict], str | dict] | None:
        """(tools as dicts, choice) when tools take part in this request, else None."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        choice = self.tool_choice or "auto"
        if choice == "none":
            return None
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            names = [t["function"]["name"] for t in tools]
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in "
                                    f"tools ({', '.join(names)})", param="tool_choice")
            choice = choice.model_dump()
        return tools, choice


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    json_schema: dict[str, Any] | str | None = None


def parse_request(cls: type[_Model], body: Any) -> Any:
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        more = f" (and {e.error_count() - 1} more problem(s))" if e.error_count() > 1 else ""
        raise APIError(400, f"{loc or 'body'}: {err['msg']}{more}", param=loc or None) from e


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _is_union_tag(part: Any) -> bool:
    # pydantic names union members in the location (messages.0.content.str, tool_choice.NamedToolChoice,
    # prompt.list[int]); keep the field names and indices only
    if isinstance(part, int):
        return False
    return part in _TYPE_NAMES or not re.fullmatch(r"[a-z_][a-z0-9_]*", part)


# ----------------------------------------------------------------------- chat -> prompt
def chat_prompt(req: ChatCompletionRequest, tokenizer: Any, tools: list[dict] | None) -> str:
    """The prompt text of a chat request, rendered by the model's chat template."""
    native_tools = tools is not None and tool_calls.template_renders_tools(tokenizer)
    messages = []
    for msg in req.messages:
        content = msg.text()
        if msg.role == "assistant" and msg.tool_calls and not native_tools:
            calls = "\n".join(tool_calls.render_call(c.function.name, c.function.arguments) for c in msg.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        item: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role, "content": content}
        if native_tools and msg.tool_calls:
            item["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
        if msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            item["name"] = msg.name
        messages.append(item)
    kwargs: dict[str, Any] = {}
    if tools is not None:
        if native_tools:
            kwargs["tools"] = tools
        else:
            section = tool_calls.tools_system_prompt(tools)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{section}"}
            else:
                messages.insert(0, {"role": "system", "content": section})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as e:  # jinja raises for conversations the template refuses
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e


def chat_constraint(req: ChatCompletionRequest, tool_mode) -> dict[str, str]:
    """The grammar constraint of a chat request: tools, response_format or SGLang's fields."""
    found: dict[str, str] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found["json_schema"] = ANY_JSON_OBJECT
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format.json_schema is required when type is 'json_schema'",
                           param="response_format.json_schema")
        found["json_schema"] = json.dumps(fmt.json_schema.schema_)
    if req.json_schema is not None:
        found["json_schema"] = req.json_schema if isinstance(req.json_schema, str) else json.dumps(req.json_schema)
    if tool_mode is not None:
        c = tool_calls.constraint(tool_mode[0], tool_mode[1], req.parallel_tool_calls)
        if c and (found or req.regex or req.ebnf):
            raise APIError(400, "tools cannot be combined with response_format or another constraint",
                           param="tool_choice")
        found.update(c or {})
    return found


# ----------------------------------------------------------------------- logprobs and usage
def _token(tokenizer: Any, tid: int) -> str:
    return tokenizer.decode([tid])


def chat_logprobs(tokenizer: Any, entries: list, tops: list) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` items from [logprob, id, _] entries and their top-k rows."""
    out = []
    for i, (lp, tid, _) in enumerate(entries):
        tok = _token(tokenizer, tid)
        row = tops[i] if i < len(tops) else []
        out.append({
            "token": tok, "logprob": lp, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": (t := _token(tokenizer, a)), "logprob": alp, "bytes": list(t.encode())}
                             for alp, a, _ in row],
        })
    return out


def completion_logprobs(tokenizer: Any, entries: list, tops: list | None, text_offset: int = 0) -> dict[str, Any]:
    """OpenAI completions `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset})."""
    tokens, offsets = [], []
    pos = text_offset
    for _, tid, _ in entries:
        tok = _token(tokenizer, tid)
        tokens.append(tok)
        offsets.append(pos)
        pos += len(tok)
    top = None
    if tops is not None:
        top = [None if row is None else {_token(tokenizer, a): alp for alp, a, _ in row} for row in tops]
    return {"tokens": tokens, "token_logprobs": [e[0] for e in entries], "top_logprobs": top,
            "text_offset": offsets}


def usage(prompt_states: list, all_states: list) -> dict[str, Any]:
    """Usage of a request: each prompt counted once (its first sample), every sample's completion."""
    prompt = sum(s.last.prompt_tokens for s in prompt_states)
    cached = sum(s.last.cached_tokens for s in prompt_states)
    completion = sum(s.last.completion_tokens for s in all_states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(finish) -> str | None:
    if finish is None:
        return None
    return {"stop": "stop", "length": "length"}.get(finish.type, "abort")
