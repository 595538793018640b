"""Conversions between OpenAI requests and the runtime: messages -> prompt, constraints, token
logprobs -> OpenAI's two logprob shapes, usage, finish reasons."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.server import tool_calls
from radixlm.server.errors import APIError
from radixlm.server.openai_models import ChatCompletionRequest, CompletionRequest, constraint_of

_ROLES = {"developer": "system", "function": "tool"}  # OpenAI's newer and older names
# apply_chat_template's own arguments: chat_template_kwargs may not override them
_RESERVED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


# ----------------------------------------------------------------------- chat -> prompt
def chat_prompt(req: ChatCompletionRequest, tokenizer: Any, tools: list[dict] | None,
                fmt: tool_calls.ToolFormat = tool_calls.HERMES) -> str:
    """The prompt text of a chat request, rendered by the model's chat template."""
    return render_chat(tokenizer, *chat_template_args(req, tokenizer, tools, fmt))


def chat_template_args(req: ChatCompletionRequest, tokenizer: Any, tools: list[dict] | None,
                       fmt: tool_calls.ToolFormat = tool_calls.HERMES) -> tuple[list[dict], dict[str, Any]]:
    """The messages (plain dicts) and keyword arguments apply_chat_template gets for a request;
    tools and earlier calls are written in `fmt` where the template does not render them."""
    native_tools = tools is not None and tool_calls.template_renders_tools(tokenizer)
    messages = []
    for msg in req.messages:
        content, calls = msg.text(), msg.calls()
        if msg.role == "assistant" and calls and not native_tools:
            rendered = "\n".join(tool_calls.render_call(c.function.name, c.function.arguments, fmt) for c in calls)
            content = f"{content}\n{rendered}" if content else rendered
        item: dict[str, Any] = {"role": _ROLES.get(msg.role, msg.role), "content": content}
        if native_tools and calls:
            item["tool_calls"] = [c.model_dump(exclude={"index"}) for c in calls]
        if msg.tool_call_id is not None:
            item["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            item["name"] = msg.name
        messages.append(item)
    kwargs: dict[str, Any] = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED}
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.continue_final_message:
        if messages[-1]["role"] != "assistant":
            raise APIError(400, "continue_final_message needs an assistant message last", param="messages")
        kwargs["continue_final_message"] = True
    if tools is not None:
        messages, extra = with_tools(messages, tools, native_tools, fmt)
        kwargs.update(extra)
    add = req.add_generation_prompt  # vLLM's field
    if add and req.continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                       param="add_generation_prompt")
    kwargs["add_generation_prompt"] = not req.continue_final_message if add is None else add
    return messages, kwargs


def with_tools(messages: list[dict], tools: list[dict], native: bool,
               fmt: tool_calls.ToolFormat = tool_calls.HERMES) -> tuple[list[dict], dict[str, Any]]:
    """The messages and template arguments that show `tools` to the model: the template's own
    `tools` argument when it renders them (`native`), else tool_calls' system-prompt section."""
    if native:
        return messages, {"tools": tools}
    section = tool_calls.tools_system_prompt(tools, fmt)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{section}"}, *messages[1:]], {}
    return [{"role": "system", "content": section}, *messages], {}


def render_chat(tokenizer: Any, messages: list[dict], kwargs: dict[str, Any]) -> str:
    """apply_chat_template to text; a 400 when the template refuses the conversation."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja raises for conversations the template refuses
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e


def format_constraint(req: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """The grammar constraint of response_format, SGLang's json_schema or vLLM's structural_tag,
    structured_outputs or guided_* field: one of them at most (two for one answer are refused rather
    than one silently picked)."""
    guided = req.guided_constraint()  # a 400 beside any other of these already
    given = [(name, constraint) for name, constraint in (
        ("response_format", req.response_format.constraint() if req.response_format is not None else None),
        ("json_schema", constraint_of("json", req.json_schema) if req.json_schema is not None else None),
        ("structural_tag", {"structural_tag": req.structural_tag} if req.structural_tag is not None else None),
        ("structured_outputs", req.structured_outputs.constraint() if req.structured_outputs is not None else None),
        *([guided] if guided is not None else [])) if constraint]
    if len(given) > 1:
        raise APIError(400, f"{given[1][0]} cannot be combined with {given[0][0]}: give one of them", param=given[1][0])
    return given[0][1] if given else {}


def chat_constraint(req: ChatCompletionRequest, tool_mode,
                    tool_field: Callable[[int], str] | None = None) -> dict[str, str]:
    """The grammar constraint of a chat request: tools, or `format_constraint`'s.
    `tool_field`: the request's name for tool i's parameters (chat's by default)."""
    found = format_constraint(req)
    if tool_mode is not None:
        try:
            c = tool_calls.constraint(tool_mode[0], tool_mode[1], req.parallel_tool_calls is not False, *tool_mode[2:])
        except tool_calls.ToolSchemaError as e:
            field = (tool_field or req.tool_field)(e.index)
            raise APIError(400, f"invalid {field}: {e.problem}", param=field) from e
        if c and (found or req.regex or req.ebnf):
            raise APIError(400, "tools cannot be combined with response_format or another constraint",
                           param="tool_choice")
        found.update(c or {})
    return found


# ----------------------------------------------------------------------- logprobs and usage
def _token(tokenizer: Any, tid: int) -> str:
    return tokenizer.decode([tid])


class _TokenIdNames:
    """Decodes a token as `token_id:N` (vLLM's return_tokens_as_token_ids): logprobs a client maps to exact
    ids, which text cannot give for a token that holds part of a character."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"token_id:{i}" for i in ids)


def logprob_names(tokenizer: Any, req: Any) -> Any:
    """What names the tokens of a request's logprobs: the tokenizer, or their ids when it asks for them."""
    return _TokenIdNames() if getattr(req, "return_tokens_as_token_ids", None) else tokenizer


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
    """OpenAI completions `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}). Each
    `top_logprobs` entry holds the top-k row and the token itself with its own logprob (up to
    logprobs + 1 entries, as OpenAI); null where the token has no logprob (a prompt's first) or
    where `tops` gives None for it."""
    tokens, offsets = [], []
    pos = text_offset
    for _, tid, _ in entries:
        tok = _token(tokenizer, tid)
        tokens.append(tok)
        offsets.append(pos)
        pos += len(tok)
    top = None
    if tops is not None:
        top = []
        for i, (lp, _, _) in enumerate(entries):
            row = tops[i] if i < len(tops) else []
            if row is None or lp is None:
                top.append(None)
                continue
            chosen = {_token(tokenizer, a): alp for alp, a, _ in row}
            chosen[tokens[i]] = lp  # exactly token_logprobs[i], so a greedy token is max(top.values())
            top.append(chosen)
    return {"tokens": tokens, "token_logprobs": [e[0] for e in entries], "top_logprobs": top,
            "text_offset": offsets}


def logprobs_end(logprobs: dict[str, Any], start: int) -> int:
    """The text offset after a completion_logprobs() result (where the next chunk's tokens begin)."""
    if not logprobs["tokens"]:
        return start
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


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
