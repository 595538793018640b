"""Public API of the language: gen, select, roles, the default backend (and @function, from
function.py)."""

from __future__ import annotations

import re
import warnings
from typing import Any

from radixlm.lang.backend import Backend, as_backend, resolve_backend
from radixlm.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlm.lang.function import Function, function
from radixlm.lang.global_config import global_config
from radixlm.lang.ir import (
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    schema_to_str,
    to_expr,
)

__all__ = ["Function", "function"]  # re-exported: `from radixlm.lang.api import function` keeps working

# --- default backend -------------------------------------------------------------------------


def set_default_backend(backend: Any) -> None:
    """Use `backend` for every program run without backend=: an Engine (as is, no wrapper), a
    Runtime, a RuntimeEndpoint, an OpenAI backend, or any radixlm.lang.Backend. Stored in
    `global_config.default_backend`."""
    global_config.default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    backend = global_config.default_backend
    return None if backend is None else as_backend(backend)


def flush_cache(backend: Any = None) -> bool:
    """Empty the runtime's prefix cache; True when it was flushed."""
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict:
    return resolve_backend(backend).get_server_info()


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - SGLang's name for a class factory
    """Launch a RadixLM server in a child process (SGLang's Runtime); see server_runtime.py."""
    from radixlm.lang.server_runtime import Runtime as _Runtime

    return _Runtime(*args, **kwargs)


# --- expressions ------------------------------------------------------------------------------

def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        ignore_eos: bool | None = None, return_logprob: bool | None = None,
        logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None, dtype: Any = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: Any = None, *, repetition_penalty: float | None = None,
        token_healing: bool | None = None) -> Expr:
    """Generate text and store it as variable `name`. SGLang's signature and argument order.

    Unset settings fall back to the run()'s defaults. `min_tokens`: no stop (EOS, stop strings)
    before that many tokens. `regex` / `json_schema` (str, dict or a pydantic model class)
    constrain the output; `dtype` (int, float, bool, str) sets SGLang's regex for the type (and,
    for int and float, stops at a space or newline); the value stays a string. `choices` makes
    this a `select`. `return_text_in_logprobs`: logprob entries carry the token's text.
    `token_healing` (RadixLM): back off the prompt's last token and let the first generated token
    extend it, so a prompt ending in a space ("A week has ") does not force an unnatural
    tokenization; off by default, so outputs stay SGLang's.
    """
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if regex is not None:
        _check_regex(regex)
    if dtype is not None and regex is not None:
        warnings.warn(f"gen: both dtype and regex are set; only dtype is used (dtype={dtype!r})", stacklevel=2)
        regex = None
    params = GenParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty, ignore_eos=ignore_eos, token_healing=token_healing, dtype=dtype,
        regex=regex, json_schema=None if json_schema is None else schema_to_str(json_schema),
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )
    return Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
            stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
            stop_regex: str | list[str] | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
            frequency_penalty: float | None = None, presence_penalty: float | None = None,
            ignore_eos: bool | None = None, return_logprob: bool | None = None,
            logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
            return_text_in_logprobs: bool | None = None, **extra: Any) -> Expr:
    """`gen(name, ..., dtype=int)`: an integer, as a string (SGLang's signature; keyword-only
    extras: repetition_penalty, token_healing)."""
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs, int, **_gen_extras(extra))


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
               stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
               stop_regex: str | list[str] | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               ignore_eos: bool | None = None, return_logprob: bool | None = None,
               logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
               return_text_in_logprobs: bool | None = None, **extra: Any) -> Expr:
    """`gen(name, ..., dtype=str)`: a double-quoted string of word characters and whitespace
    (SGLang's REGEX_STR)."""
    return gen(name, max_tokens, None, n, stop, stop_token_ids, stop_regex, temperature, top_p, top_k, min_p,
               frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
               top_logprobs_num, return_text_in_logprobs, str, **_gen_extras(extra))


def _gen_extras(extra: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(extra) - {"repetition_penalty", "token_healing"})
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    return extra


def _check_regex(regex: str) -> None:
    """Fail at the gen() call, as SGLang does, for a regex Python cannot even parse."""
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"gen: invalid regex {regex!r}: {e}") from e


def image(expr: Any) -> Expr:
    """SGLang's image input. Not supported: RadixLM serves text-only models."""
    raise NotImplementedError("radixlm.lang.image: multimodal input (images) is not supported; "
                              "RadixLM serves text-only models")


def video(path: str, num_frames: int) -> Expr:
    """SGLang's video input. Not supported: RadixLM serves text-only models."""
    raise NotImplementedError("radixlm.lang.video: multimodal input (video) is not supported; "
                              "RadixLM serves text-only models")


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Expr:
    """Append the best of `choices` (scored by `choices_method`) and store it as `name`."""
    if not choices:
        raise ValueError("select: choices must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select: every choice must be a non-empty string")
    if temperature < 0:
        raise ValueError("select: temperature must be >= 0")
    return Select(name, list(choices), float(temperature), choices_method)


def _role(role: str, expr: Any = None) -> ExprList:
    inner = [] if expr is None else [to_expr(expr)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    """A system message: `s += system("You are ...")`."""
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
