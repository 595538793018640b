"""Tracing: run a program function on a recorder instead of a backend (SGLang's Function.trace).

`prog.trace(**some_args)` calls the program with a TracerProgramState: every node it appends is
recorded in order (nothing is generated), arguments not given are Argument placeholders, and a
generated variable read back (`s["x"]`) is a Variable placeholder. `run_batch` uses this to find a
program's constant prefix (text and role markers up to the first argument, gen or select) and
cache it once before the batch runs (`global_config.enable_precache_with_tracing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from radixlm.lang.ir import (
    Constant,
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    to_expr,
)
from radixlm.lang.state import RoleMethods


class StopTracing(Exception):
    """Raised while extracting a prefix when the program does something a prefix cannot cover."""


@dataclass(eq=False)
class Argument(Expr):
    """A program argument that trace() was not given. Cannot be formatted into a string: the
    tracer would lose track of it (SGLang's rule)."""

    name: str

    def __format__(self, spec: str) -> str:
        raise TypeError(f"cannot put the argument {self.name!r} inside an f-string while tracing; use +")

    def __str__(self) -> str:  # str(arg) / "%s" % arg would bake a placeholder into the prefix
        raise TypeError(f"the argument {self.name!r} has no value while tracing")


@dataclass(eq=False)
class Variable(Expr):
    """A variable a traced gen/select (or var_scope) produces, read back with s[name]."""

    name: str
    source: Expr | None = None


class TracerProgramState(RoleMethods):
    """The recorder a traced program receives as `s` (and what Function.trace returns)."""

    def __init__(self, backend: Any, arguments: dict[str, Any], only_trace_prefix: bool = False) -> None:
        self.backend = backend
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.nodes: list[Expr] = []
        self.variables: dict[str, Variable] = {}
        self.ret_value: Any = None
        self.child_states: list[TracerProgramState] = []

    # --- appending -------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> TracerProgramState:
        self._record(to_expr(other))
        return self

    def _record(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for child in expr.exprs:
                self._record(child)
            return
        if isinstance(expr, (Gen, Select)):
            name = expr.name or f"{type(expr).__name__.lower()}_{len(self.variables)}"
            self.variables[name] = Variable(name, expr)
        self.nodes.append(expr)

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self._record(ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)]))
            return None

        @contextmanager
        def block() -> Iterator[TracerProgramState]:
            self._record(RoleBegin(role))
            yield self
            self._record(RoleEnd(role))

        return block()

    @contextmanager
    def var_scope(self, name: str) -> Iterator[TracerProgramState]:
        self._record(VarScopeBegin(name))
        yield self
        self._record(VarScopeEnd(name))
        self.variables[name] = Variable(name)

    def fork(self, size: int = 1) -> list[TracerProgramState]:
        """Branches that record on their own (a fork ends a prefix)."""
        if self.only_trace_prefix:
            raise StopTracing()
        branches = [TracerProgramState(self.backend, self.arguments) for _ in range(int(size))]
        for b in branches:
            b.variables = dict(self.variables)
        self.child_states.extend(branches)
        return _TracedForks(branches)

    # --- reading ---------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        if name in self.arguments and not isinstance(self.arguments[name], Argument):
            return self.arguments[name]
        if name not in self.variables:
            raise KeyError(f"no variable {name!r} while tracing")
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = Variable(name)

    def __getattr__(self, name: str) -> Any:
        # text(), messages(), get_meta_info()...: nothing has run, so there is nothing to read
        if name.startswith("_"):
            raise AttributeError(name)
        raise StopTracing() if self.only_trace_prefix else AttributeError(
            f"{name}() is not available while tracing a program (nothing runs)")

    def flatten_nodes(self) -> list[Expr]:
        return list(self.nodes)

    def prefix_text(self) -> str:
        """The text of the leading constant nodes, role markers rendered with the backend's chat
        template ("" without a backend)."""
        out, first = [], True
        for node in self.nodes:
            if isinstance(node, Constant):
                out.append(node.value)
            elif isinstance(node, (RoleBegin, RoleEnd)) and self.backend is not None:
                template = self.backend.chat_template
                out.append(template.begin(node.role, first) if isinstance(node, RoleBegin) else template.end(node.role))
                first = first and isinstance(node, RoleBegin)
            else:
                break
        return "".join(out)


class _TracedForks(list):
    def join(self, mode: str = "gather_variable") -> None:
        pass


def _arguments(program: Any, given: dict[str, Any]) -> dict[str, Any]:
    args = {name: Argument(name) for name in program.arg_names if name not in given}
    return {**args, **given, **program.bind_arguments}


def trace_program(program: Any, arguments: dict[str, Any], backend: Any) -> TracerProgramState:
    """Run ``program.func`` on a recorder; arguments it was not given become placeholders."""
    args = _arguments(program, arguments)
    tracer = TracerProgramState(backend, args)
    tracer.ret_value = program.func(tracer, **args)
    return tracer


def extract_prefix(program: Any, backend: Any) -> str:
    """The program's constant prefix, every argument a placeholder ("" when it has none): what
    the program appends before the first argument, gen, select or fork."""
    args = _arguments(program, {})
    tracer = TracerProgramState(backend, args, only_trace_prefix=True)
    try:
        program.func(tracer, **args)
    except Exception:  # noqa: BLE001 - best effort: the program needed a value tracing cannot give
        pass  # the prefix is what it appended before that
    return tracer.prefix_text()
