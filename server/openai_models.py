"""OpenAI request models (pydantic, strict about values: a mistyped value is a 400 naming it).

Liberal about names: every field the OpenAI API or SGLang's OpenAI routes define is declared, so a
client's `message.model_dump()` or SGLang-specific body is accepted. Each model lists the names
that cannot change a local model's answer (IGNORED: accepted, logged at debug) and those RadixLM
cannot serve (UNSUPPORTED: accepted only at the listed no-op values). A name no API defines
(`temprature`) is still a 400 naming it.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from radixlm.constrained.base import ANY_JSON_OBJECT
from radixlm.server.errors import APIError

logger = logging.getLogger("radixlm.server.openai")


MAX_ITEMS = 2048  # entries of a list field of a body (messages, input items, tools): OpenAI's bound on messages
MAX_PARTS = 4 * MAX_ITEMS  # content parts over all of a body's messages or items


class RequestModel(BaseModel):
    """A request body (or a part of one): strict values, every name an API defines accepted.
    COUNTED: the list fields parse_request bounds (MAX_ITEMS entries, MAX_PARTS content parts in all)
    before anything walks them."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    IGNORED: ClassVar[frozenset[str]] = frozenset()
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}
    COUNTED: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _accept_known_names(cls, data: Any) -> Any:
        """Drops IGNORED names (debug log) and UNSUPPORTED ones at a no-op value; 400 for the others."""
        if not isinstance(data, dict):
            return data
        known = data.keys() & (cls.IGNORED | cls.UNSUPPORTED.keys())
        if not known:
            return data
        for name in sorted(known & cls.UNSUPPORTED.keys()):
            if data[name] not in cls.UNSUPPORTED[name]:
                raise APIError(400, f"{name} is not supported by RadixLM (got {data[name]!r:.80}); leave it unset",
                               param=name)
        logger.debug("%s: ignoring %s (no effect on this server's answer)", cls.__name__, ", ".join(sorted(known)))
        return {k: v for k, v in data.items() if k not in known}


# ----------------------------------------------------------------------- chat messages and tools
class FunctionDef(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    IGNORED = frozenset({"defer_loading", "key_order"})  # SGLang


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDef
    IGNORED = frozenset({"defer_loading"})


def tool_dicts(tools: list[Tool] | None) -> list[dict]:
    """Tools as the plain dicts the chat template and tool_calls.py take."""
    return [t.model_dump(include={"type", "function"}, exclude_none=True) for t in tools or []]


class ToolList(RequestModel):
    """A `tools` list on its own (/apply_chat_template), validated as chat's is."""

    tools: list[Tool]
    COUNTED = ("tools",)


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionName


class CalledFunction(RequestModel):
    name: str
    arguments: str


class MessageToolCall(RequestModel):
    id: str | None = None
    index: int | None = None  # streamed deltas carry it; clients send it back
    type: Literal["function"] = "function"
    function: CalledFunction


MEDIA_PARTS = ("image_url", "input_audio", "file", "video_url", "audio_url")


class ContentPart(RequestModel):
    # media parts are declared so that they are refused by name (ChatCompletionRequest._text_only):
    # they need a model this server does not load
    type: Literal["text", "refusal", "image_url", "input_audio", "file", "video_url", "audio_url"]
    text: str | None = None
    refusal: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    video_url: Any = None
    audio_url: Any = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    function_call: CalledFunction | None = None  # legacy single call of an assistant message
    refusal: str | None = None
    # what clients send back from a response: openai's model_dump(), LiteLLM, SGLang
    IGNORED = frozenset({"annotations", "audio", "reasoning_content", "provider_specific_fields", "prefix", "phase",
                         "tools"})

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or p.refusal or "" for p in self.content)
        return self.content or self.refusal or ""

    def calls(self) -> list[MessageToolCall]:
        legacy = [MessageToolCall(function=self.function_call)] if self.function_call else []
        return (self.tool_calls or []) + legacy


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class StructureFormat(RequestModel):
    """One structure of a structural_tag response_format (SGLang's form): after a trigger, `begin`,
    a JSON value per `schema` (any JSON value when it is left out) and `end`."""
    begin: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


# the fields each response_format type takes (beside `type`); text and json_object take none
_FORMAT_PARTS = {"json_schema": ("json_schema", "schema"), "structural_tag": ("structures", "triggers", "format")}


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructureFormat] | None = None  # structural_tag, SGLang's form (and vLLM's legacy one)
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None  # structural_tag, xgrammar's form (vLLM's): xgrammar serves it
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # SGLang's json_schema shorthand
    UNSUPPORTED = {"at_least_one": (False,)}  # SGLang's structural_tag flag: "at least one structure"

    def constraint(self) -> dict[str, str]:
        """The grammar constraint this format asks for ({} for text)."""
        fields = {"json_schema": self.json_schema, "schema": self.schema_, "structures": self.structures,
                  "triggers": self.triggers, "format": self.format}
        own = _FORMAT_PARTS.get(self.type, ())
        stray = next((name for name, value in fields.items() if value is not None and name not in own), None)
        if stray is not None:
            raise APIError(400, f"response_format.{stray} does not go with type {self.type!r}",
                           param=f"response_format.{stray}")
        if self.type == "json_object":
            return {"json_schema": ANY_JSON_OBJECT}
        if self.type == "json_schema":
            if (self.json_schema is None) == (self.schema_ is None):
                raise APIError(400, "response_format.json_schema is required when type is 'json_schema' (or SGLang's "
                                    "response_format.schema, not both)", param="response_format.json_schema")
            return {"json_schema": json.dumps(self.json_schema.schema_ if self.json_schema else self.schema_)}
        if self.type != "structural_tag":
            return {}
        if self.format is not None:
            if self.structures is not None or self.triggers is not None:
                raise APIError(400, "response_format takes either format or structures and triggers, not both",
                               param="response_format.format")
            return {"structural_tag": json.dumps({"type": "structural_tag", "format": self.format})}
        if not self.structures or not self.triggers:
            raise APIError(400, "response_format.structures and response_format.triggers (both non-empty) are "
                                "required when type is 'structural_tag' (or xgrammar's response_format.format)",
                           param="response_format.structures" if not self.structures else "response_format.triggers")
        structures = [{"begin": s.begin, "schema": {} if s.schema_ is None else s.schema_, "end": s.end}
                      for s in self.structures]
        return {"structural_tag": json.dumps({"type": "structural_tag", "structures": structures,
                                              "triggers": self.triggers})}


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM/SGLang: usage in every chunk too (with include_usage)
    IGNORED = frozenset({"include_obfuscation"})


# ----------------------------------------------------------------------- requests
_COMMON_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                   "prompt_cache_options", "safety_identifier", "extra_key", "cache_salt", "priority",
                   "data_parallel_rank", "custom_params", "session_id", "custom_labels", "images_config",
                   "mm_processor_kwargs", "return_cached_tokens_details", "return_spec_tokens_details",
                   "routed_experts_start_len", "guided_decoding_backend",
                   # SGLang's routing (prefill/decode disaggregation, data-parallel ranks) and n-gram drafting hints
                   "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank", "disagg_prefill_dp_rank",
                   "ngram_corpus_id",
                   # vLLM's: beam search's length penalty (no beam search runs), a request id for its logs,
                   # disaggregation and custom-processor arguments, and a decode option fast tokenizers lack
                   "length_penalty", "request_id", "kv_transfer_params", "vllm_xargs", "spaces_between_special_tokens")
_COMMON_UNSUPPORTED = {"lora_path": (None,), "session_params": (None,), "custom_logit_processor": (None,),
                       "watermark": (None,), "return_hidden_states": (None, False),
                       "return_routed_experts": (None, False), "guided_whitespace_pattern": (None,),
                       # vLLM's sampling extras RadixLM does not run
                       "use_beam_search": (None, False), "prompt_logprobs": (None,), "logits_processors": (None,),
                       "thinking_token_budget": (None,)}
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")  # vLLM's, one at most
_REGEX_META = frozenset("\\.^$|?*+()[]{}/")


class StructuredOutputs(RequestModel):
    """vLLM's structured_outputs: one constraint (as its guided_* fields and structural_tag)."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # compact JSON and closed objects are what RadixLM's grammars write anyway; the fallback is not needed
    IGNORED = frozenset({"disable_fallback", "disable_any_whitespace", "disable_additional_properties"})
    UNSUPPORTED = {"whitespace_pattern": (None,)}

    def constraint(self) -> dict[str, str]:
        given = {name: value for name, value in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                                 ("grammar", self.grammar), ("structural_tag", self.structural_tag))
                 if value is not None}
        if self.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise APIError(400, "structured_outputs takes exactly one of json, regex, choice, grammar, json_object "
                                f"or structural_tag (got {', '.join(given) or 'none'})", param="structured_outputs")
        ((name, value),) = given.items()
        return constraint_of(name, value)


def constraint_of(kind: str, value: Any) -> dict[str, str]:
    """The grammar constraint of one of vLLM's kinds (structured_outputs' names, as guided_* name them
    too): json (a schema, or its JSON text), json_object, choice (any of the strings, verbatim),
    regex, grammar (EBNF) or structural_tag."""
    if kind == "json":
        return {"json_schema": value if isinstance(value, str) else json.dumps(value)}
    if kind == "json_object":
        return {"json_schema": ANY_JSON_OBJECT}
    if kind == "choice":
        return {"regex": "(" + "|".join(_literal_regex(c) for c in value) + ")"}
    return {{"regex": "regex", "grammar": "ebnf", "structural_tag": "structural_tag"}[kind]: value}


class _Common(RequestModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # SGLang extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None
    rid: str | None = None
    # vLLM's guided decoding, served by the constraints above
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structural_tag: str | None = None  # vLLM's (a JSON string), as SGLang's sampling_params.structural_tag
    structured_outputs: StructuredOutputs | None = None  # vLLM's successor to guided_*
    include_stop_str_in_output: bool | None = None  # vLLM's name for no_stop_trim
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # vLLM's: only the last k prompt tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens are sampled
    bad_words: list[str] | None = None  # vLLM's: words the output never completes
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids beside the text
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name their tokens "token_id:N"
    IGNORED = frozenset(_COMMON_IGNORED)
    UNSUPPORTED = _COMMON_UNSUPPORTED

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": self.n, "sampling_seed": self.seed,
                                  "min_new_tokens": self.min_tokens}
        if self.include_stop_str_in_output is not None:
            if self.no_stop_trim is not None and self.no_stop_trim != self.include_stop_str_in_output:
                raise APIError(400, "include_stop_str_in_output and no_stop_trim (its SGLang name) disagree",
                               param="include_stop_str_in_output")
            params["no_stop_trim"] = self.include_stop_str_in_output
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
                     "skip_special_tokens", "no_stop_trim", "regex", "ebnf", "logit_bias", "allowed_token_ids",
                     "bad_words"):
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's rule: continuous_usage_stats counts with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def truncated(self, ids: list[int], context_len: int, room: int | None) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: as many as the context holds beside
        `room` new tokens, one when the request names no length), or the prompt itself."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        keep = context_len - max(room or 1, 1) if k == -1 else k
        return ids[-keep:] if 0 < keep < len(ids) else ids

    def guided_constraint(self) -> tuple[str, dict[str, str]] | None:
        """(field, constraint) for vLLM's guided_* field: guided_json -> json_schema, guided_regex ->
        regex, guided_choice -> a regex of the choices, guided_grammar -> ebnf. One at most, and not
        beside SGLang's json_schema, regex or ebnf: two constraints for one answer are a 400."""
        given = [name for name in GUIDED if getattr(self, name) is not None]
        if not given:
            return None
        others = given[1:] + [name for name in ("json_schema", "regex", "ebnf", "structural_tag", "structured_outputs")
                              if getattr(self, name) is not None]
        if others:
            raise APIError(400, f"{given[0]} cannot be combined with {others[0]}: give one constraint",
                           param=given[0])
        name = given[0]
        return name, constraint_of(name.removeprefix("guided_"), getattr(self, name))


def _literal_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


_CHAT_IGNORED = ("verbosity", "prediction",
                 "return_prompt_token_ids", "return_meta_info", "return_input_ids_in_sglext",
                 "return_output_ids_in_sglext", "return_flat_raw_output_top_logprobs", "max_dynamic_patch",
                 "min_dynamic_patch", "use_audio_in_video", "video_config", "task", "media_io_kwargs")
_CHAT_UNSUPPORTED = {"audio": (None,), "modalities": (None, ["text"]), "web_search_options": (None,),
                     "thinking": (None,), "input_ids": (None,), "return_sampling_mask": (None, False),
                     "sampling_logprobs_mode": (None,),
                     # vLLM's: a per-request template (a client's Jinja would run unbounded here), echo of the
                     # last message, special tokens added around the template's own
                     "chat_template": (None,), "echo": (None, False), "add_special_tokens": (None, False)}


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | Annotated[
    float, Field(ge=0.0, le=0.99, allow_inf_nan=False)]  # OpenAI's tiers, or SGLang's fine-grained float


class ReasoningOptions(RequestModel):
    """SGLang's `reasoning` object on chat (its Responses-style spelling of reasoning_effort)."""
    effort: ReasoningEffort | None = None
    reasoning_effort: ReasoningEffort | None = None
    enabled: bool | None = None
    enable: bool | None = None
    IGNORED = frozenset({"summary", "generate_summary"})


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    reasoning_effort: ReasoningEffort | None = None
    reasoning: ReasoningOptions | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None  # the legacy form of tools
    function_call: Literal["none", "auto"] | FunctionName | None = None  # ... and of tool_choice
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None  # vLLM's; null: true unless continue_final_message
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None  # vLLM's: retrieved documents for templates that render them
    separate_reasoning: bool = True  # SGLang's: with --reasoning-parser, the thinking goes to reasoning_content
    stream_reasoning: bool = True  # SGLang's: false streams the thinking in one piece once it ends
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out of the answer (split off, dropped)
    # null: the server's default (control-token text in content is plain text unless the server runs
    # with --allow-control-tokens-in-content); false needs that flag (server/chat_tokens.py)
    sanitize_control_tokens: bool | None = None
    IGNORED = frozenset(_COMMON_IGNORED + _CHAT_IGNORED)
    UNSUPPORTED = {**_COMMON_UNSUPPORTED, **_CHAT_UNSUPPORTED}
    COUNTED = ("messages", "tools", "functions")

    @model_validator(mode="after")
    def _thinking_switches(self) -> ChatCompletionRequest:
        """As SGLang: a reasoning effort (or `reasoning.enabled`) sets the chat template's `thinking` and
        `enable_thinking` (the switches Qwen3, DeepSeek and others read) unless chat_template_kwargs sets
        them: effort "none" turns thinking off, any other effort on. Templates that read neither are
        unaffected."""
        r = self.reasoning
        effort = self.reasoning_effort
        if effort is None and r is not None:
            effort = r.effort if r.effort is not None else r.reasoning_effort
        thinking = None
        if r is not None and (r.enabled if r.enabled is not None else r.enable):
            thinking = True
        if effort is not None:
            thinking = effort != "none"
        if thinking is not None:
            kwargs = dict(self.chat_template_kwargs or {})
            kwargs.setdefault("thinking", thinking)
            kwargs.setdefault("enable_thinking", thinking)
            self.chat_template_kwargs = kwargs
        return self

    @model_validator(mode="after")
    def _unique_tool_names(self) -> ChatCompletionRequest:
        check_unique_names([t.function.name for t in self.tools or []], "tools", "{}.function.name")
        check_unique_names([f.name for f in self.functions or []], "functions", "{}.name")
        return self

    @model_validator(mode="after")
    def _text_only(self) -> ChatCompletionRequest:
        for i, msg in enumerate(self.messages):
            for j, part in enumerate(msg.content if isinstance(msg.content, list) else []):
                if part.type in MEDIA_PARTS:
                    raise APIError(400, f"messages[{i}].content[{j}] is an {part.type!r} part: RadixLM serves "
                                        "text-only models, so only 'text' (and 'refusal') content parts are accepted",
                                   param=f"messages.{i}.content.{j}.type")
        return self

    @property
    def legacy_functions(self) -> bool:
        """The request uses the legacy `functions` (answered with `function_call`, not `tool_calls`)."""
        return bool(self.functions) and not self.tools

    def tool_field(self, index: int | None) -> str:
        """The request's name for the parameters schema of tool_mode's tool `index` (None: the tools)."""
        tools = self.tools or []
        if index is None:
            return "tools" if tools else "functions"
        if index < len(tools):
            return f"tools.{index}.function.parameters"
        return f"functions.{index - len(tools)}.parameters"

    def tool_mode(self) -> tuple[list[dict], str | dict] | None:
        """(tools as dicts, choice) when tools take part in this request, else None."""
        tools = tool_dicts(self.tools)
        tools += [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions or []]
        choice: Any = self.tool_choice
        if choice is None and self.function_call is not None:
            fc = self.function_call
            choice = fc if isinstance(fc, str) else {"type": "function", "function": {"name": fc.name}}
        if not tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        choice = choice or "auto"
        if choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            choice = choice.model_dump()
        if isinstance(choice, dict):
            names = [t["function"]["name"] for t in tools]
            if choice["function"]["name"] not in names:
                raise APIError(400, f"tool_choice names the function {choice['function']['name']!r}, which is not "
                                    f"in tools ({', '.join(names)})", param="tool_choice")
        return tools, choice


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    response_format: ResponseFormat | None = None  # vLLM's and SGLang's, as chat's
    UNSUPPORTED = {**_COMMON_UNSUPPORTED, "suffix": (None, ""), "add_special_tokens": (None, True)}

    def check_best_of(self) -> None:
        if self.best_of not in (None, 1, self.n):  # best_of > n picks by likelihood: not implemented
            raise APIError(400, f"best_of={self.best_of} is not supported by RadixLM (only best_of = n)",
                           param="best_of")


@functools.cache
def _lists_of(cls: type[RequestModel]) -> type[msgspec.Struct]:
    """A msgspec type reading only `cls`'s counted lists, each entry left undecoded (msgspec.Raw)."""
    fields = [(name, list[msgspec.Raw] | None, None) for name in cls.COUNTED]
    return msgspec.defstruct(f"{cls.__name__}Lists", fields, forbid_unknown_fields=False)


def count_raw(cls: type[RequestModel], body: bytes) -> None:
    """check_counts' entry bound on the undecoded body: a list of 45,000 items is refused after a
    scan of its bytes (milliseconds), before a decode builds 45,000 objects. A body this cannot
    read (not JSON, a field of another type) is left to the full decode and validation."""
    try:
        lists = msgspec.json.decode(body, type=_lists_of(cls))
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return
    for field in cls.COUNTED:
        entries = getattr(lists, field)
        if entries is not None and len(entries) > MAX_ITEMS:
            raise APIError(400, f"{field} has {len(entries)} entries, the limit is {MAX_ITEMS}", param=field)


def check_unique_names(names: list[str], field: str, where: str) -> None:
    """400 for a function name given twice in `field` (OpenAI refuses it: a call could not say which
    it means); `where` formats the later one's place ("{}.function.name")."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise APIError(400, f"{field} has two functions named {name!r}: function names must be unique",
                           param=where.format(f"{field}.{i}"))
        seen.add(name)


def check_counts(cls: type[RequestModel], body: Any) -> None:
    """400 for a list field of `body` past MAX_ITEMS entries, or past MAX_PARTS content parts in all,
    counted before the body is validated (validating tens of thousands of empty messages takes most
    of a second)."""
    if not isinstance(body, dict):
        return
    parts = 0
    for field in cls.COUNTED:
        entries = body.get(field)
        if not isinstance(entries, list):
            continue
        if len(entries) > MAX_ITEMS:
            raise APIError(400, f"{field} has {len(entries)} entries, the limit is {MAX_ITEMS}", param=field)
        for entry in entries:
            content = entry.get("content", entry.get("output")) if isinstance(entry, dict) else None
            parts += len(content) if isinstance(content, list) else 0
        if parts > MAX_PARTS:
            raise APIError(400, f"{field} hold more than {MAX_PARTS} content parts in all", param=field)


def parse_request(cls: type[RequestModel], body: Any) -> Any:
    """A body as the model `cls`: counted (check_counts), then validated; 400 naming the first problem."""
    check_counts(cls, body)
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
        more = f" (and {e.error_count() - 1} more problem(s))" if e.error_count() > 1 else ""
        raise APIError(400, f"{loc or 'body'}: {err['msg']}{more}", param=loc or None) from e
    if isinstance(req, CompletionRequest):
        req.check_best_of()
    return req


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _is_union_tag(part: Any) -> bool:
    # pydantic names union members in the location (messages.0.content.str, tool_choice.NamedToolChoice,
    # prompt.list[int]); keep the field names and indices only
    if isinstance(part, int):
        return False
    return part in _TYPE_NAMES or not (part.isidentifier() and part.islower())
