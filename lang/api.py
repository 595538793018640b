"""Public API of the language: @function, gen, select, roles and the default backend."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from radixlm.lang.backend import Backend, as_backend
from radixlm.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixlm.lang.interpreter import Executor
from radixlm.lang.ir import (
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    dtype_regex,
    schema_to_str,
    to_expr,
)
from radixlm.lang.state import ProgramState

# --- default backend -------------------------------------------------------------------------

_default_backend: Backend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """Use `backend` for every program run without backend=: an Engine (as is, no wrapper),
    a RuntimeEndpoint, an OpenAI backend, or any radixlm.lang.Backend."""
    global _default_backend
    with _default_lock:
        _default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend


def _resolve(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise RuntimeError("no backend: call radixlm.lang.set_default_backend(...) or pass backend=")
    return _default_backend


def flush_cache(backend: Any = None) -> bool:
    """Empty the runtime's prefix cache; True when it was flushed."""
    return _resolve(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict:
    return _resolve(backend).get_server_info()


# --- programs --------------------------------------------------------------------------------

# Keyword arguments of run()/run_batch() that set the program's default sampling settings; every
# other keyword argument is passed to the program function.
_RUN_SAMPLING_ARGS = frozenset(
    {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
     "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
     "return_logprob", "logprob_start_len", "top_logprobs_num"}
)
_RUN_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                 "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False}


def _split_run_kwargs(kwargs: dict[str, Any]) -> tuple[GenParams, dict[str, Any]]:
    sampling = {k: v for k, v in kwargs.items() if k in _RUN_SAMPLING_ARGS}
    program_kwargs = {k: v for k, v in kwargs.items() if k not in _RUN_SAMPLING_ARGS}
    return GenParams(**{**_RUN_DEFAULTS, **sampling}), program_kwargs


def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator turning `def prog(s, ...)` into a program: `prog.run(...)`, `prog.run_batch(...)`.

    Usable as `@function` or `@function(num_api_spec_tokens=...)` (accepted for SGLang
    compatibility; API speculative execution is not implemented and the value has no effect).
    """
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)
    return Function(func, num_api_spec_tokens=num_api_spec_tokens)


class Function:
    def __init__(self, func: Callable, num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> Function:
        """A copy with some program arguments fixed."""
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`prog(s, ...)` inside another program runs it on that state; otherwise `prog.run(...)`."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run the program once; returns its state.

        Sampling defaults for every gen in the program: max_new_tokens (128), temperature (1.0),
        top_p, top_k, min_p, frequency_penalty, presence_penalty, repetition_penalty, ignore_eos,
        stop, stop_token_ids, return_logprob, logprob_start_len, top_logprobs_num; other keyword
        arguments go to the program. Without stream, returns when the program has finished, and
        an exception raised by the program's own code propagates. With stream=True, returns at
        once (the program runs on a background thread): follow it with `state.text_iter()`.
        """
        defaults, program_kwargs = _split_run_kwargs(kwargs)
        return _run_program(self, _resolve(backend), args, program_kwargs, defaults, stream,
                            capture_errors=stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False,
                  **kwargs: Any) -> list[ProgramState]:
        """Run the program once per dict of arguments, concurrently (their gen calls batch in the
        runtime). Returns the states in input order. An item that fails does not stop the others:
        its state's `error` holds the exception and reading its variables raises it.
        """
        defaults, extra = _split_run_kwargs(kwargs)
        if extra:
            raise TypeError(f"run_batch: unexpected keyword arguments {sorted(extra)}; "
                            "program arguments go in batch_kwargs")
        items = list(batch_kwargs)
        for item in items:
            if not isinstance(item, dict):
                raise TypeError(
                    f"run_batch: each item must be a dict of program arguments, got {type(item).__name__}"
                )
        resolved = _resolve(backend)
        if num_threads == "auto":
            num_threads = max(64, 16 * (os.cpu_count() or 1))
        num_threads = max(1, min(int(num_threads), len(items) or 1))

        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(items))
        states: list[ProgramState | None] = [None] * len(items)

        def one(i: int) -> None:
            states[i] = _run_program(self, resolved, (), items[i], defaults, False, capture_errors=True)

        try:
            if num_threads == 1:
                for i in range(len(items)):
                    one(i)
                    if bar is not None:
                        bar.update(1)
            else:
                with ThreadPoolExecutor(num_threads, thread_name_prefix="radixlm-batch") as pool:
                    for future in as_completed([pool.submit(one, i) for i in range(len(items))]):
                        future.result()
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return states  # type: ignore[return-value]


def _run_program(program: Function, backend: Backend, args: tuple, kwargs: dict[str, Any],
                 defaults: GenParams, stream: bool, capture_errors: bool) -> ProgramState:
    executor = Executor(backend, defaults, stream=stream)
    state = ProgramState(executor)

    def body() -> None:
        try:
            state.ret_value = program.func(state, *args, **{**program.bind_arguments, **kwargs})
        except Exception as e:
            executor.fail(e)
            if not capture_errors:
                raise
        finally:
            executor.end()

    if stream:
        threading.Thread(target=body, name="radixlm-stream-program", daemon=True).start()
        return state
    body()
    executor.sync()
    return state


# --- expressions ------------------------------------------------------------------------------

def gen(name: str | None = None, max_tokens: int | None = None, stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
        frequency_penalty: float | None = None, presence_penalty: float | None = None,
        repetition_penalty: float | None = None, ignore_eos: bool | None = None,
        return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, dtype: Any = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: Any = None) -> Expr:
    """Generate text and store it as variable `name`.

    Unset settings fall back to the run()'s defaults. `regex` / `json_schema` (str, dict or a
    pydantic model class) constrain the output; `dtype` (int, float, bool, str) sets a regex and
    the value stays a string. `choices` makes this a `select` (choices_method, temperature 0).
    """
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      choices_method or token_length_normalized)
    if dtype is not None:
        if regex is not None or json_schema is not None:
            raise ValueError("gen: dtype cannot be combined with regex or json_schema")
        regex = dtype_regex(dtype)
    params = GenParams(
        max_new_tokens=max_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
        regex=regex, json_schema=None if json_schema is None else schema_to_str(json_schema),
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
    )
    return Gen(name, params)


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    """`gen(name, dtype=int, ...)`: an integer, as a string."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    """`gen(name, dtype=str, ...)`: a double-quoted string literal."""
    return gen(name, dtype=str, **kwargs)


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
