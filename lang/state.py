"""What a program function receives as `s`: ProgramState, and ForkedStates from `s.fork(n)`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.lang.interpreter import Executor
from radixlm.lang.ir import (
    ConcatAndAppend,
    Expr,
    ExprList,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    to_expr,
)


class _RoleCall:
    """Result of `s.user()` with no content: a context manager for a `with` block."""

    def __init__(self, state: ProgramState, role: str) -> None:
        self._state, self._role = state, role

    def __enter__(self) -> ProgramState:
        self._state._executor.submit(RoleBegin(self._role))
        return self._state

    def __exit__(self, *exc: Any) -> None:
        self._state._executor.submit(RoleEnd(self._role))


class RoleMethods:
    """`s.system/user/assistant(...)`: a message, or with no content a `with` block. Subclasses
    implement `_role(role, expr)` (ProgramState runs it, the tracer records it)."""

    def _role(self, role: str, expr: Any = None) -> Any:
        raise NotImplementedError

    def system(self, expr: Any = None) -> Any:
        """`s.system("...")` appends a system message; `with s.system():` opens a block."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)


class ProgramState(RoleMethods):
    """The state of one running program: its text, chat messages and variables.

    `s += "text"`, `s += gen("x")`, `s += select(...)` append and return at once; `s["x"]`
    waits until x exists. `s.text()` / `s.messages()` wait for everything submitted so far.
    If the program failed, `s.error()` returns the exception and every variable read raises it.
    """

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self.ret_value: Any = None  # what the program function returned

    # --- appending -------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        self._executor.submit(other)
        return self

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is None:
            return _RoleCall(self, role)
        self._executor.submit(ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)]))
        return None

    @contextmanager
    def var_scope(self, name: str) -> Iterator[ProgramState]:
        """Capture the text appended inside the block as variable `name`."""
        self._executor.submit(VarScopeBegin(name))
        try:
            yield self
        finally:
            self._executor.submit(VarScopeEnd(name))

    # --- forking ---------------------------------------------------------------------------
    def fork(self, size: int = 1) -> ForkedStates:
        """`size` copies of this state that run concurrently (each its own worker thread)."""
        return ForkedStates([ProgramState(e) for e in self._executor.fork(size)], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """A single fork, joined (gather_variable) when the block exits."""
        forks = self.fork(1)
        try:
            yield forks[0]
        finally:
            forks.join()

    # --- reading ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return self._executor.has_var(name)

    def get_var(self, name: str) -> Any:
        return self._executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """Meta info of the gen/select that produced `name` (waits for it): the runtime's
        meta_info for a gen; scores ("normalized_prompt_logprobs", ...) for a select."""
        return self._executor.get_meta_info(name)

    def text(self) -> str:
        self._executor.sync()
        return self._executor.text_

    def messages(self) -> list[dict]:
        self._executor.sync()
        return [dict(m) for m in self._executor.messages_]

    def sync(self) -> None:
        self._executor.sync()

    def error(self) -> BaseException | None:
        """The exception that stopped the program, or None (waits for submitted work first)."""
        self._executor.sync()
        return self._executor.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the state text (or variable `var_name`) piece by piece as it is generated; the
        pieces concatenate to the final value. Token-by-token with `run(stream=True)`."""
        return self._executor.iter_text(var_name)

    async def text_async_iter(self, var_name: str | None = None,
                              return_meta_data: bool = False) -> AsyncIterator[Any]:
        """`text_iter` for `async for`: waits off the event loop. With `var_name` and
        `return_meta_data=True`, yields (piece, meta info so far) pairs (SGLang's shape)."""
        loop = asyncio.get_running_loop()
        pieces, done = self._executor.iter_text(var_name), object()
        while True:
            piece = await loop.run_in_executor(None, next, pieces, done)
            if piece is done:
                return
            if var_name is not None and return_meta_data:
                yield piece, self._executor.current_meta(var_name)
            else:
                yield piece

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ForkedStates:
    """The branches of `s.fork(n)`: index or iterate them, append to all with `+=`, then join."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:  # `forks[i] += x` assigns the same state back
            raise ValueError("fork branches cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ForkedStates:
        """Append to every branch: a str/node, a list (one item per branch), or f(i)."""
        for i, state in enumerate(self.states):
            if isinstance(other, (list, tuple)):
                state += other[i]
            elif callable(other) and not isinstance(other, Expr):
                state += other(i)
            else:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for the branches and merge them into the parent.

        gather_variable: every variable a branch produced becomes, in the parent, the list of
        the branches' values (index i = branch i). concate_and_append: the text each branch
        added is appended to the parent, branch after branch.
        A branch's error is raised here.
        """
        executors = [s._executor for s in self.states]
        try:
            self._join(executors, mode)
        finally:
            for e in executors:
                e.end()

    def _join(self, executors: list[Executor], mode: str) -> None:
        if mode == "gather_variable":
            for e in executors:
                e.sync()
                if e.error is not None:
                    raise e.error
            names = sorted(set().union(*(e.assigned for e in executors)))
            for name in names:
                values = [e.variables.get(name) for e in executors]
                self.parent._executor.set_var(name, values, [e.meta_info.get(name) for e in executors])
        elif mode == "concate_and_append":
            self.parent._executor.submit(ConcatAndAppend(executors))
            self.parent._executor.sync()
            if self.parent._executor.error is not None:
                raise self.parent._executor.error
        else:
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
