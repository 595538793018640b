"""SGLang's native routes: POST|PUT /generate, /apply_chat_template, /tokenize and /detokenize
(also under /v1/)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from radixlm.runtime.request.errors import RequestError
from radixlm.runtime.request.reasoning import REASONING_FORMATS, ReasoningFormat
from radixlm.server.chat_tokens import chat_ids, sanitize_wanted
from radixlm.server.common import (
    NATIVE_NAMES,
    SSE_DONE,
    SSE_HEADERS,
    build,
    finish_error,
    first_event,
    guarded_sse,
    off_loop,
    raise_request_error,
    read_fields,
    read_json,
    sse,
    submit,
    tm_of,
)
from radixlm.server.errors import APIError, JSONResponse
from radixlm.server.messages import TextOut
from radixlm.server.openai_convert import with_tools
from radixlm.server.openai_models import ChatCompletionRequest, ToolList, parse_request, tool_dicts
from radixlm.server.reasoning import ThinkingSplit, wait_for_thinking
from radixlm.server.reasoning import split as split_thinking
from radixlm.server.request_state import ReqState
from radixlm.server.tool_calls import template_renders_tools

logger = logging.getLogger("radixlm.server.native")
router = APIRouter()

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "require_reasoning",
                   "separate_reasoning"}
# SGLang GenerateReqInput fields with no effect on a single local server's answer: accepted, ignored.
GENERATE_IGNORED = frozenset({
    "log_metrics", "no_logs", "routing_key", "priority", "custom_labels", "data_parallel_rank", "routed_dp_rank",
    "disagg_prefill_dp_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size", "conversation_id", "external_trace_header", "received_time", "http_worker_ipc", "extra_key",
    "cache_salt", "session_id", "background", "kv_hints", "modalities", "use_audio_in_video", "video_config",
    "images_config", "mm_processor_kwargs", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
    "video_max_dynamic_patch", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "return_prompt_token_ids"})
# SGLang fields RadixLM cannot serve (multimodal input, LoRA, hidden states, ...): accepted while unset.
GENERATE_UNSET = {"input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
                  "session_params", "lora_path", "lora_id", "custom_logit_processor", "sampling_logprobs_mode",
                  "watermark", "positional_embed_overrides", "max_thinking_tokens",
                  "multi_item_delimiter_indices", "token_indices_to_pool", "return_hidden_states",
                  "return_routed_experts", "return_indexer_topk", "return_sampling_mask",
                  "return_bytes", "return_entropy", "return_flat_raw_top_logprobs",
                  "return_flat_raw_output_top_logprobs", "routed_experts_start_len"}


def generate_args(body: dict[str, Any]) -> dict[str, Any]:
    """The fields /generate serves; 400 naming an unknown field or an unsupported one that is set."""
    for key, value in body.items():
        if key in GENERATE_UNSET and value not in (None, False, 0, [], {}):
            raise APIError(400, f"{key} is not supported by RadixLM (got {value!r:.80}); leave it unset", param=key)
        if key not in GENERATE_FIELDS and key not in GENERATE_UNSET and key not in GENERATE_IGNORED:
            raise APIError(400, f"unknown field {key!r} in the request body", param=key)
    for key in ("stream", "return_text_in_logprobs", "require_reasoning", "separate_reasoning"):
        if not isinstance(body.get(key, False), bool) and body.get(key) is not None:
            raise APIError(400, f"{key} must be true or false", param=key)
    return {k: v for k, v in body.items() if k in GENERATE_FIELDS}


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    g = generate_args(await read_json(request))
    stream = bool(g.get("stream"))
    groups, is_batch = await build(request, NATIVE_NAMES, g.get("text"), g.get("input_ids"), g.get("sampling_params"),
                             g.get("return_logprob"), g.get("logprob_start_len"), g.get("top_logprobs_num"),
                             stream, g.get("rid"), token_ids_logprob=g.get("token_ids_logprob"))
    reqs = [r for group in groups for r in group]
    tm = tm_of(request)
    reasoning = _reasoning(tm, g)
    if g.get("require_reasoning"):  # SGLang's field: the constraint judges what follows the thinking
        wait_for_thinking(reqs, reasoning, tm)
    group = submit(request, reqs, stream=stream)
    index = {r.rid: i for i, r in enumerate(reqs)}
    tokenizer = tm.tokenizer
    parts = {r.rid: _Parts(reasoning) for r in reqs} if g.get("separate_reasoning") else {}
    incremental = tm.args.incremental_streaming_output  # a chunk's own text and ids, not those so far

    def render(state: ReqState, step: TextOut | None = None) -> dict:
        out = state.to_dict()
        if step is not None and incremental:
            out["text"], out["output_ids"] = step.text, list(step.new_ids)
        if parts:  # "text" is the answer, "reasoning_text" the thinking
            split = parts[state.rid]
            seen = len(split.content), len(split.reasoning)
            split.update(state.text if step is None else step.text, state.finish is not None)
            content, thought = (split.content, split.reasoning) if step is None or not incremental else (
                split.content[seen[0]:], split.reasoning[seen[1]:])
            out["text"], out["reasoning_text"] = content, thought or None
        if g.get("return_text_in_logprobs"):
            _add_logprob_text(tokenizer, out["meta_info"])
        if len(reqs) > 1:
            out["index"] = index[state.rid]
        return out

    if not stream:
        states = {s.rid: s for s in await group.results(request)}
        for s in states.values():
            raise_request_error(s, NATIVE_NAMES)
        results = [[render(states[r.rid]) for r in grp] for grp in groups]
        per_prompt = [res if len(res) > 1 else res[0] for res in results]
        return JSONResponse(per_prompt if is_batch else per_prompt[0])

    state, out = await first_event(group, request, NATIVE_NAMES)

    async def chunks() -> AsyncIterator[bytes]:
        s, o = state, out
        try:
            while True:
                if o.finish is not None and o.finish.type == "abort" and o.finish.code:
                    yield sse(finish_error(o.finish).body())  # failed or refused: an error event, as SGLang
                elif o.text or o.new_ids or o.finish is not None:
                    yield sse(render(s, o))
                if group.done:
                    break
                s, o = await group.next()
            yield SSE_DONE
        finally:
            group.close()

    return StreamingResponse(guarded_sse(chunks()), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/apply_chat_template")
async def apply_chat_template(request: Request) -> Response:
    body = await read_fields(request, {"messages", "add_generation_prompt", "tools", "model"})
    messages, add = body.get("messages"), body.get("add_generation_prompt", True)
    if not isinstance(messages, list) or not all(isinstance(x, dict) for x in messages):
        raise APIError(400, "messages must be a list of objects", param="messages")
    if not isinstance(add, bool):
        raise APIError(400, "add_generation_prompt must be a boolean", param="add_generation_prompt")
    tokenizer, extra = tm_of(request).tokenizer, {}
    if body.get("tools"):  # shown to the model as /v1/chat/completions shows them
        listed = await off_loop(request, NATIVE_NAMES, parse_request, ToolList, {"tools": body["tools"]})
        tools = tool_dicts(listed.tools)
        messages, extra = with_tools(messages, tools, template_renders_tools(tokenizer), tm_of(request).tool_format)
    try:
        text = await off_loop(request, NATIVE_NAMES, lambda: tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add, **extra))
    except Exception as e:  # jinja raises for conversations the template refuses
        raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from e
    return JSONResponse({"text": text})


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(request: Request) -> Response:
    """SGLang's/vLLM's tokenize: {"prompt": str | [str]} or {"messages": [...]} -> token ids."""
    body = await read_json(request)
    tm = tm_of(request)
    add_special = body.pop("add_special_tokens", True)
    body.pop("model", None)
    if not isinstance(add_special, bool):
        raise APIError(400, "add_special_tokens must be a boolean", param="add_special_tokens")
    if "messages" in body:  # the ids chat feeds the model (control-token text in content sanitized)
        chat = await off_loop(request, NATIVE_NAMES, parse_request, ChatCompletionRequest, body)
        sanitize = sanitize_wanted(chat.sanitize_control_tokens, tm.args.allow_control_tokens_in_content)
        def ids_of(chat: ChatCompletionRequest) -> list[int]:  # with the tools chat would render into the prompt
            tool_mode = chat.tool_mode()
            return chat_ids(chat, tm.builder, tool_mode[0] if tool_mode else None, sanitize, tm.tool_format)

        ids = await off_loop(request, NATIVE_NAMES, ids_of, chat)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": tm.context_len})
    if set(body) != {"prompt"}:
        raise APIError(400, "send exactly one of prompt or messages (and optionally add_special_tokens, model)",
                       param=next(iter(set(body) - {"prompt"}), "prompt"))
    batch = isinstance(body["prompt"], list)
    prompts = body["prompt"] if batch else [body["prompt"]]
    if not all(isinstance(p, str) for p in prompts):
        raise APIError(400, "prompt must be a string or a list of strings", param="prompt")
    _check_count(tm, len(prompts), "prompt")
    ids = await off_loop(request, NATIVE_NAMES, lambda: [tm.tokenizer(p, add_special_tokens=add_special).input_ids
                                                        for p in prompts])
    return JSONResponse({"tokens": ids if batch else ids[0], "count": [len(x) for x in ids] if batch else len(ids[0]),
                         "max_model_len": tm.context_len})


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(request: Request) -> Response:
    body = await read_fields(request, {"tokens", "skip_special_tokens", "model"})
    tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
    if not isinstance(skip, bool):
        raise APIError(400, "skip_special_tokens must be a boolean", param="skip_special_tokens")
    tm = tm_of(request)
    batch = isinstance(tokens, list) and bool(tokens) and isinstance(tokens[0], list)
    lists = tokens if batch else [tokens]
    _check_count(tm, len(lists), "tokens")

    def decode() -> list[str]:  # a body of max_request_bytes holds millions of ids: checked off the event loop too
        try:
            for ids in lists:
                tm.builder.check_ids(ids)
        except RequestError as e:
            raise APIError(400, e.describe("tokens"), param="tokens") from e
        return [tm.tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists]

    texts = await off_loop(request, NATIVE_NAMES, decode)
    return JSONResponse({"text": texts if batch else texts[0]})


def _check_count(tm, count: int, field: str) -> None:
    """(De)tokenize calls are bounded as /generate batches are: with tiny entries, a body within
    max_request_bytes could otherwise ask for a million tokenizer calls, seconds of work. Entry sizes
    are bounded only by max_request_bytes: a text longer than the context can be tokenized (to count
    its tokens, as vLLM and SGLang allow), and a 4 MB one costs what 300 prompts of 13 kB do."""
    if count > tm.max_in_flight:
        raise APIError(400, f"{field} has {count} entries, the limit per call is {tm.max_in_flight} (as for a "
                            "/generate batch: max_running_requests + max_queued_requests); split the request",
                       param=field)


def _reasoning(tm, g: dict[str, Any]) -> ReasoningFormat | None:
    """The server's reasoning format when the request asks for it; 400 when it cannot be served."""
    wanted = [k for k in ("require_reasoning", "separate_reasoning") if g.get(k)]
    if not wanted:
        return None
    if tm.reasoning is None:
        raise APIError(400, f"{wanted[0]} needs a server started with --reasoning-parser", param=wanted[0])
    if g.get("require_reasoning") and tm.thinking_tokens is None:
        raise APIError(400, f"require_reasoning: this model's tokenizer spells {tm.reasoning.end} in several tokens, "
                            "so a constraint cannot wait for it", param="require_reasoning")
    return tm.reasoning


class _Parts:
    """One generation's thinking and answer so far, read as its text arrives (server/reasoning.py)."""

    def __init__(self, fmt: ReasoningFormat):
        self.split = ThinkingSplit(fmt)
        self.reasoning, self.content = "", ""

    def update(self, delta: str, finished: bool) -> None:
        for piece in self.split.feed(delta) + (self.split.finish() if finished else []):
            self.reasoning += piece.get("reasoning_content", "")
            self.content += piece.get("content", "")


@router.post("/separate_reasoning")
async def separate_reasoning(request: Request) -> Response:
    """SGLang's route: {"text", "reasoning_parser"} -> {"text": the answer, "reasoning_text": the thinking}."""
    body = await read_json(request)
    unknown = sorted(set(body) - {"text", "reasoning_parser"})
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r} in the request body", param=unknown[0])
    text, name = body.get("text"), body.get("reasoning_parser")
    if not isinstance(text, str):
        raise APIError(400, "text must be a string", param="text")
    fmt = REASONING_FORMATS.get(name) if isinstance(name, str) else tm_of(request).reasoning if name is None else None
    if fmt is None:
        raise APIError(400, f"reasoning_parser must be one of {sorted(REASONING_FORMATS)}"
                            + ("" if name is not None else " (the server has none)"), param="reasoning_parser")
    thought, content, _ = split_thinking(text, fmt)
    return JSONResponse({"text": content, "reasoning_text": thought})


def _add_logprob_text(tokenizer, meta: dict) -> None:
    for key in ("input_token_logprobs", "output_token_logprobs"):
        for entry in meta.get(key, []):
            entry[2] = tokenizer.decode([entry[1]])
    for key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs"):
        for row in meta.get(key, []):
            for entry in row or []:
                entry[2] = tokenizer.decode([entry[1]])
