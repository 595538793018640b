"""Tool calls for /v1/chat/completions: prompting and constraining (tool_stream.py reads them back).

Formats (`--tool-call-parser`; `auto`, the default, picks from the chat template's own words):
- hermes (also qwen, qwen25, qwen3), the default where the template names none:

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- llama3: a bare JSON object, `{"name": "get_weather", "parameters": {"city": "Paris"}}`;
- mistral: `[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]`.

Models whose chat template renders `tools` get them through the template. Templates that ignore
tools (SmolLM2's) get the format described in a system prompt section (`tools_system_prompt`).

Constraints (the arguments always parse and validate against the tool's JSON schema; an object
schema that lists properties takes no other keys, as in `response_format`; a tool without
`parameters` takes none, as OpenAI reads it):
- a named function: the whole output is the arguments, constrained by that tool's `parameters`
- "required": the output is a JSON array (or, with parallel_tool_calls=false, one object) of
  `{"name": ..., "arguments": ...}`, one anyOf branch per tool
- "auto": free text; once the model writes the opener `<tool_call>` a structural tag takes over and
  forces `{"name": <a tool>, "arguments": <its schema>}` followed by `</tool_call>`
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from radixlm.constrained.json_schema import (
    REF_KEYWORDS,
    close_objects,
    keywords_used,
    rebase_refs,
    without_unreachable_bounds,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BARE_OPEN = '{"name"'  # where a llama3 call starts in free text


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    open: str  # what opens the calls ("" for llama3's bare object)
    close: str  # what closes one call ("" when nothing does)
    array: bool  # the calls after `open` are one JSON array
    args_key: str  # the member holding the arguments

    def wrap(self, call: str) -> str:
        """One call object (JSON text) as the format writes it."""
        if self.array:
            return f"{self.open}[{call}]"
        return f"{self.open}\n{call}\n{self.close}" if self.open else call

    def tag(self) -> tuple[str, str, str]:
        """(what precedes a call object, what follows it, the trigger) of the "auto" structural tag."""
        if self.array:
            return f"{self.open}[", "}]", self.open
        return (f"{self.open}\n", f"}}\n{self.close}", self.open) if self.open else ("", "}", BARE_OPEN)


HERMES = ToolFormat("hermes", OPEN, CLOSE, array=False, args_key="arguments")
LLAMA3 = ToolFormat("llama3", "", "", array=False, args_key="parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", array=True, args_key="arguments")
TOOL_FORMATS = {"hermes": HERMES, "qwen": HERMES, "qwen25": HERMES, "qwen3": HERMES, "llama3": LLAMA3,
                "mistral": MISTRAL}


def tool_format(name: str | None, tokenizer: Any) -> ToolFormat:
    """The format `--tool-call-parser` names; `auto` (or none given) reads it off the chat template:
    Mistral's templates write [TOOL_CALLS], Llama 3.x's ask for "parameters" (or hold <|python_tag|>),
    Hermes/Qwen's write <tool_call>; a template that names none gets Hermes'."""
    if name not in (None, "auto"):
        return TOOL_FORMATS[name]
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        return HERMES
    if MISTRAL.open in template:
        return MISTRAL
    if OPEN in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters"' in template:
        return LLAMA3
    return HERMES


NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def tools_system_prompt(tools: list[dict], fmt: ToolFormat = HERMES) -> str:
    signatures = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    head = ("# Tools\n\n"
            "You may call one or more functions to help answer the user. Each function's signature is a "
            "JSON object on its own line inside <tools></tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n\n")
    if fmt.name == "llama3":
        return head + ('To call a function, answer with only a JSON object with its name and parameters:\n'
                       '{"name": "<function name>", "parameters": {<arguments as JSON>}}')
    if fmt.name == "mistral":
        return head + ("To call functions, write [TOOL_CALLS] and then a JSON array with one object per call:\n"
                       '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as JSON>}}]')
    return head + ("To call a function, write one JSON object with its name and arguments inside "
                   "<tool_call></tool_call> tags:\n"
                   f'{OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE}')


def render_call(name: str, arguments: str, fmt: ToolFormat = HERMES) -> str:
    """An earlier assistant tool call written back into the prompt in the format."""
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return fmt.wrap(json.dumps({"name": name, fmt.args_key: args}, ensure_ascii=False))


def parameters_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or NO_PARAMETERS


def _calls_schema(tools: list[dict], parallel: bool, args_key: str = "arguments") -> dict:
    """The "required" schema: one call (an anyOf over the tools) or a non-empty array of them. A
    tool's schema that uses references (pydantic's `$defs` and `$ref`, recursive models) moves to
    the root's `$defs` with its references rebased, so they resolve in the combined document."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        arguments = parameters_schema(tool)
        if keywords_used(arguments) & set(REF_KEYWORDS):
            defs[f"tool_{i}"] = rebase_refs(arguments, f"/$defs/tool_{i}")
            arguments = {"$ref": f"#/$defs/tool_{i}"}
        calls.append({"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                       args_key: arguments},
                      "required": ["name", args_key], "additionalProperties": False})
    one = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else dict(one)
    return {**schema, "$defs": defs} if defs else schema


class ToolSchemaError(ValueError):
    """A tool's `parameters` whose references cannot resolve: ``index`` is the tool's place in the list."""

    def __init__(self, index: int, problem: str):
        super().__init__(problem)
        self.index = index
        self.problem = problem


def _check_refs(tools: list[dict]) -> None:
    """ToolSchemaError for the first tool whose references are external or resolve to nothing,
    judged in its own schema (where the client wrote them), before schemas are combined."""
    from radixlm.constrained.base import GrammarError
    from radixlm.constrained.schema_refs import check_schema_refs

    for i, tool in enumerate(tools):
        params = parameters_schema(tool)
        if keywords_used(params) & set(REF_KEYWORDS):
            try:
                check_schema_refs(json.dumps(params))
            except GrammarError as e:
                raise ToolSchemaError(i, str(e).removeprefix("invalid json_schema: ")) from e


def constraint(tools: list[dict], choice: str | dict, parallel: bool,
               fmt: ToolFormat = HERMES) -> dict[str, str] | None:
    """The sampling_params constraint for a tool_choice ("auto", "required" or a named tool);
    ToolSchemaError for a tool whose references do not resolve. "required" is the calls' JSON alone
    in every format (tool_stream reads it so); "auto" lets the model write text and opens a call
    where it writes the format's opener."""
    _check_refs(tools)
    if isinstance(choice, dict):
        tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        return {"json_schema": json.dumps(parameters_schema(tool))}
    if choice == "required":
        # a bare object is one call a turn (llama3)
        return {"json_schema": json.dumps(_calls_schema(tools, parallel and bool(fmt.open), fmt.args_key))}
    if choice == "auto":
        head, end, trigger = fmt.tag()
        structures = [{
            "begin": f'{head}{{"name": {json.dumps(t["function"]["name"])}, "{fmt.args_key}": ',
            # closed here: json_schema constraints are closed by the grammar backends, structural tags not
            "schema": close_objects(without_unreachable_bounds(parameters_schema(t))),
            "end": end,
        } for t in tools]
        return {"structural_tag": json.dumps({"type": "structural_tag", "structures": structures,
                                              "triggers": [trigger]})}
    return None


def schema_owner(tools: list[dict], choice: str | dict, fmt: ToolFormat = HERMES) -> int | None:
    """The index of the one tool whose `parameters` the constraint of `choice` is built from (so an
    error about it names that tool); None when it combines several."""
    if isinstance(choice, dict):
        return next(i for i, t in enumerate(tools) if t["function"]["name"] == choice["function"]["name"])
    return 0 if len(tools) == 1 else None
