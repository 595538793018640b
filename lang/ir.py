"""The IR of a RadixLM program: the nodes a program appends to its state.

A program never talks to a model directly. `s += "text" + gen("x")` builds IR nodes (this module)
and submits them to the state's executor (`interpreter.py`), which runs them in order on the
state's worker thread. Every node is a small dataclass; `a + b` concatenates nodes into an
`ExprList`, and plain strings become `Constant` nodes.

Node            appends to the state text                     produces
Constant        its value                                     -
Gen             the model's continuation                      variable `name` + meta info
Select          the chosen option                             variable `name` + meta info (scores)
ExprList        each child in order                           whatever the children produce
RoleBegin/End   the chat template's begin/end strings         a message in `s.messages()` (at End)
VarScopeBegin/End  nothing                                    variable `name` = text appended in between
ConcatAndAppend the text each fork branch added               -
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# The regexes `gen(dtype=...)` constrains to, SGLang's exactly (the value stays a string). int and
# float also stop at a space or a newline (DTYPE_STOPS), so "A week has 7 days" ends after "7".
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""  # SGLang's: word characters and whitespace between double quotes
DTYPE_REGEX: dict[str, str] = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}
DTYPE_STOPS: dict[str, list[str]] = {"int": [" ", "\n"], "float": [" ", "\n"]}


class Expr:
    """Base of every IR node: supports `node + node` and `"text" + node`."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])


def to_expr(value: Any) -> Expr:
    """Coerce what a user appends (`str` or IR node) into an IR node."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    if value is None:
        raise ValueError("cannot append None to a program state")
    raise TypeError(f"cannot append {type(value).__name__} to a program state; use a str or gen()/select()")


@dataclass(eq=False)
class Constant(Expr):
    """Literal text."""

    value: str


@dataclass(eq=False)
class ExprList(Expr):
    """Several nodes run in order (what `+` builds)."""

    exprs: list[Expr]

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*self.exprs, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), *self.exprs])


@dataclass(slots=True)
class GenParams:
    """Sampling settings of one gen call, with SGLang's field names; None means "not set here".

    A program's defaults come from `.run(...)`; each `gen(...)` overrides the fields it sets
    (`override`). Only the set fields are sent, so the backend's own defaults apply to the rest.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_regex: list[str] | None = None
    token_healing: bool | None = None
    dtype: str | None = None  # int, float, bool, str: a regex and stops, added when the request is made
    regex: str | None = None
    json_schema: str | None = None
    # Not sampling settings: they ask the backend for log-probabilities in the meta info.
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "stop_regex"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])
            elif value is not None:
                setattr(self, name, list(value))
        if self.dtype is not None:
            self.dtype = dtype_name(self.dtype)
        if self.n is not None and self.n != 1:
            raise ValueError("gen: n > 1 is not supported in a program; use s.fork(n) for parallel samples")
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            self.json_schema = schema_to_str(self.json_schema)
        if self.regex is not None and self.json_schema is not None:
            raise ValueError("gen: set at most one of regex, json_schema (and dtype)")

    def override(self, other: GenParams) -> GenParams:
        """A copy of self with every field that `other` sets replaced by other's value."""
        changes = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)}
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def with_stops(self, stop: list[str], stop_token_ids: list[int]) -> GenParams:
        """A copy with extra stop strings / stop token ids (e.g. the role's end marker)."""
        old_stops, old_ids = list(self.stop or []), list(self.stop_token_ids or [])
        stops = old_stops + [s for s in stop if s not in old_stops]
        ids = old_ids + [t for t in stop_token_ids if t not in old_ids]
        return dataclasses.replace(self, stop=stops or None, stop_token_ids=ids or None)

    def resolve_dtype(self) -> GenParams:
        """With dtype set: a copy with its regex (replacing any regex, as SGLang does) and, for int
        and float, SGLang's extra stops (a space, a newline)."""
        if self.dtype is None:
            return self
        stops = list(self.stop or []) + [s for s in DTYPE_STOPS.get(self.dtype, []) if s not in (self.stop or [])]
        return dataclasses.replace(self, dtype=None, regex=DTYPE_REGEX[self.dtype], json_schema=None,
                                   stop=stops or None)

    def sampling_params(self) -> dict[str, Any]:
        """The `sampling_params` dict of a generate request: only the fields that are set (dtype
        already resolved into regex and stops)."""
        resolved, out = self.resolve_dtype(), {}
        for f in dataclasses.fields(resolved):
            if f.name in REQUEST_FIELDS or f.name in ("dtype", "n"):
                continue
            value = getattr(resolved, f.name)
            if value is not None and value != []:
                out[f.name] = list(value) if isinstance(value, list) else value
        return out


# Fields that go at the top level of a generate request, not in its sampling_params.
REQUEST_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def schema_to_str(schema: Any) -> str:
    """A JSON schema given as str, dict or pydantic model class, as a JSON string."""
    if isinstance(schema, str):
        return schema
    if hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if not isinstance(schema, dict):
        raise TypeError("json_schema must be a str, a dict or a pydantic model class")
    return json.dumps(schema)


def dtype_name(dtype: Any) -> str:
    """`gen(dtype=...)`'s type as a name: int, float, bool or str (the types or their names)."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None)
    name = "str" if name == "string" else name
    if name not in DTYPE_REGEX:
        raise ValueError(f"gen: unsupported dtype {dtype!r}; use one of int, float, bool, str")
    return name


@dataclass(eq=False)
class Gen(Expr):
    """Generate a continuation of the state text and store it as variable `name` (if given)."""

    name: str | None
    params: GenParams = field(default_factory=GenParams)


@dataclass(eq=False)
class Select(Expr):
    """Append the most likely of `choices`, scored in one batched prefill-only request.

    `choices_method` is one of the objects in `radixlm.lang.choices` (token_length_normalized,
    greedy_token_selection, unconditional_likelihood_normalized). With temperature > 0 the
    choice is sampled from the softmax of the method's scores instead of taking the best one.
    """

    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Any


@dataclass(eq=False)
class RoleBegin(Expr):
    """Open a chat message of `role`: appends the chat template's begin string for it."""

    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    """Close the open message: records it in `s.messages()` and appends the end string."""

    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    """Start capturing the text appended from here as variable `name`."""

    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    """Stop capturing: variable `name` = text appended since the matching VarScopeBegin."""

    name: str


@dataclass(eq=False)
class ConcatAndAppend(Expr):
    """Append the text each fork branch added after the fork point (join mode concate_and_append).

    `executors` are the branches' executors (interpreter.Executor), waited for in order.
    """

    executors: list[Any]


def produced_names(expr: Expr) -> list[str]:
    """Names of the variables that running `expr` will produce (so readers know to wait)."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, VarScopeBegin):
        return [expr.name]
    if isinstance(expr, ExprList):
        return [name for e in expr.exprs for name in produced_names(e)]
    return []
