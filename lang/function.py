"""Programs: `@function` turns `def prog(s, ...)` into a Function with run / run_batch / trace."""

from __future__ import annotations

import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixlm.lang.backend import Backend, Prompt, resolve_backend
from radixlm.lang.global_config import global_config
from radixlm.lang.interpreter import Executor
from radixlm.lang.ir import GenParams
from radixlm.lang.state import ProgramState
from radixlm.lang.tracer import TracerProgramState, extract_prefix, trace_program

# Keyword arguments of run()/run_batch() that set the program's default sampling settings; every
# other keyword argument is passed to the program function.
_RUN_SAMPLING_ARGS = frozenset(
    {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
     "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos",
     "return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}
)
_RUN_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                 "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False}
PRECACHE_MIN_CHARS = 64  # shorter constant prefixes are not worth a request of their own (SGLang's)


def _split_run_kwargs(kwargs: dict[str, Any]) -> tuple[GenParams, dict[str, Any]]:
    sampling = {k: v for k, v in kwargs.items() if k in _RUN_SAMPLING_ARGS}
    program_kwargs = {k: v for k, v in kwargs.items() if k not in _RUN_SAMPLING_ARGS}
    return GenParams(**{**_RUN_DEFAULTS, **sampling}), program_kwargs


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator turning `def prog(s, ...)` into a program: `prog.run(...)`, `prog.run_batch(...)`.

    Usable as `@function` or `@function(num_api_spec_tokens=N)`: API speculative execution. A
    backend without a prefix cache is asked for N tokens ahead at a gen, and the program's next
    text and gens are matched against them instead of making one call each (see speculative.py).
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
        spec = inspect.getfullargspec(func)
        self.arg_names = spec.args[1:]  # after the state `s`
        self.arg_defaults = spec.defaults or ()
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> Function:
        """A copy with some program arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown and not inspect.getfullargspec(self.func).varkw:
            raise TypeError(f"bind: {self.__name__} has no argument(s) {', '.join(unknown)}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`prog(s, ...)` inside another program (or a trace) runs it on that state; otherwise
        `prog.run(...)`."""
        if args and isinstance(args[0], (ProgramState, TracerProgramState)):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run the program once; returns its state.

        Sampling defaults for every gen in the program: max_new_tokens (128), temperature (1.0),
        top_p, top_k, min_p, frequency_penalty, presence_penalty, repetition_penalty, ignore_eos,
        stop, stop_token_ids, return_logprob, logprob_start_len, top_logprobs_num,
        return_text_in_logprobs; other keyword arguments go to the program. Without stream,
        returns when the program has finished, and an exception raised by the program's own code
        propagates. With stream=True, returns at once (the program runs on a background thread):
        follow it with `state.text_iter()` or `state.text_async_iter()`.
        """
        defaults, program_kwargs = _split_run_kwargs(kwargs)
        return _run_program(self, resolve_backend(backend), args, program_kwargs, defaults, stream,
                            capture_errors=stream)

    def run_batch(self, batch_kwargs: list[dict[str, Any]] | list[tuple], *, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, generator_style: bool = False,
                  **kwargs: Any) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per item, concurrently (their gen calls batch in the runtime).

        An item is a dict of program arguments, or (SGLang) a tuple/list of argument values in
        the function's order. Returns the states in input order (``generator_style=True``: a
        generator yielding them in order). An item that fails does not stop the others: its
        state's `error()` holds the exception and reading its variables raises it. With
        `global_config.enable_precache_with_tracing`, the program's constant prefix is cached
        once first (found by tracing).
        """
        defaults, extra = _split_run_kwargs(kwargs)
        if extra:
            raise TypeError(f"run_batch: unexpected keyword arguments {sorted(extra)}; "
                            "program arguments go in batch_kwargs")
        items = [self._as_kwargs(item) for item in batch_kwargs]
        resolved = resolve_backend(backend)
        if global_config.enable_precache_with_tracing and len(items) > 1:
            self.cache(resolved)
        if num_threads == "auto":
            num_threads = max(64, 16 * (os.cpu_count() or 1))
        num_threads = max(1, min(int(num_threads), len(items) or 1))
        run = functools.partial(_run_batch, self, resolved, items, defaults, num_threads, progress_bar)
        return run() if generator_style else list(run())

    def _as_kwargs(self, item: Any) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        if isinstance(item, (list, tuple)):
            required = len(self.arg_names) - len(self.arg_defaults)
            if not required <= len(item) <= len(self.arg_names):
                raise TypeError(f"run_batch: {len(item)} argument values for {self.__name__}"
                                f"({', '.join(self.arg_names)})")
            return dict(zip(self.arg_names, item))
        raise TypeError(f"run_batch: each item must be a dict (or tuple) of program arguments, "
                        f"got {type(item).__name__}")

    def trace(self, *, backend: Any = None, **kwargs: Any) -> TracerProgramState:
        """Record the nodes the program appends, without running anything: arguments not given
        are placeholders. Returns the TracerProgramState (`nodes`, `variables`, `prefix_text()`)."""
        resolved = backend if backend is not None else global_config.default_backend
        return trace_program(self, kwargs, None if resolved is None else resolve_backend(resolved))

    def cache(self, backend: Any = None) -> str:
        """Cache the program's constant prefix in the runtime (when over 64 characters); returns it."""
        resolved = resolve_backend(backend)
        prefix = extract_prefix(self, resolved)
        if len(prefix) > PRECACHE_MIN_CHARS:
            resolved.cache_prefix(Prompt(prefix))
        return prefix


def _run_batch(program: Function, backend: Backend, items: list[dict[str, Any]], defaults: GenParams,
               num_threads: int, progress_bar: bool) -> Iterator[ProgramState]:
    bar = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(items))
    one = lambda i: _run_program(program, backend, (), items[i], defaults, False, capture_errors=True)
    try:
        if num_threads == 1:
            for i in range(len(items)):
                yield one(i)
                if bar is not None:
                    bar.update(1)
            return
        with ThreadPoolExecutor(num_threads, thread_name_prefix="radixlm-batch") as pool:
            futures = [pool.submit(one, i) for i in range(len(items))]
            if bar is not None:
                for future in futures:
                    future.add_done_callback(lambda _: bar.update(1))
            for future in futures:
                yield future.result()
    finally:
        if bar is not None:
            bar.close()


def _run_program(program: Function, backend: Backend, args: tuple, kwargs: dict[str, Any],
                 defaults: GenParams, stream: bool, capture_errors: bool) -> ProgramState:
    executor = Executor(backend, defaults, stream=stream, num_api_spec_tokens=program.num_api_spec_tokens)
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
            if global_config.verbosity >= 2:
                executor.sync()
                print(executor.text_)

    if stream:
        threading.Thread(target=body, name="radixlm-stream-program", daemon=True).start()
        return state
    body()
    executor.sync()
    return state
