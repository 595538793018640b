"""The executor behind one program state: a worker thread running the state's IR nodes in order.

`s += node` only enqueues (returns at once); reading `s["x"]` waits until the node producing x
has run. Each fork branch is its own executor, so branches' gen calls reach the backend
concurrently and the runtime batches them. Dispatch is a table: IR node type -> handler.

Shared fields (text, messages, variables, meta info, error) are guarded by one Condition;
readers wait on it and every change notifies it (this is also what streaming readers follow).
A failing node (or the program's own code raising) sets `error`: the remaining queued nodes are
skipped and every later variable read re-raises the error.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from radixlm.lang.backend import Backend, Prompt
from radixlm.lang.ir import (
    ConcatAndAppend,
    Constant,
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    produced_names,
    to_expr,
)
from radixlm.lang.speculative import ChatSpeculation, CompletionSpeculation

_END = object()  # queue sentinel: the program submits nothing more


class Executor:
    def __init__(self, backend: Backend, defaults: GenParams, stream: bool = False,
                 num_api_spec_tokens: int | None = None) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        # API speculative execution (speculative.py): chat models speculate a whole assistant
        # turn, completion interfaces the text after a gen
        chat = getattr(backend, "is_chat_model", False)
        self.spec_chat = ChatSpeculation(num_api_spec_tokens) if num_api_spec_tokens and chat else None
        self.spec = CompletionSpeculation(num_api_spec_tokens) if num_api_spec_tokens and not chat else None
        self.text_ = ""
        self.messages_: list[dict] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.assigned: set[str] = set()  # names produced by this executor (join gathers them)
        self.role: str | None = None
        self.role_start = 0
        self.scope_starts: dict[str, int] = {}
        self.fork_start = 0
        self.error: BaseException | None = None
        self.finished = False
        self.children: list[Executor] = []
        self._pending: Counter[str] = Counter()  # name -> submitted producers not yet run
        self._ended = False
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._dispatch: dict[type, Callable[[Any], None]] = {
            Constant: self._constant,
            ExprList: self._expr_list,
            Gen: self._gen,
            Select: self._select,
            RoleBegin: self._role_begin,
            RoleEnd: self._role_end,
            VarScopeBegin: self._var_scope_begin,
            VarScopeEnd: self._var_scope_end,
            ConcatAndAppend: self._concat_and_append,
        }
        self._thread = threading.Thread(target=self._work, name="radixlm-program", daemon=True)
        self._thread.start()

    # --- called from the program's thread ---------------------------------------------------
    def submit(self, value: Any) -> None:
        expr = to_expr(value)
        with self._cond:
            if self._ended:
                raise RuntimeError("this program state has finished; nothing more can be appended")
            self._pending.update(produced_names(expr))
        self._queue.put(expr)

    def sync(self) -> None:
        """Wait until every node submitted so far has run."""
        self._queue.join()

    def end(self) -> None:
        """No more nodes will come: the worker exits after the queued ones (so do the forks')."""
        with self._cond:
            if self._ended:
                return
            self._ended = True
        self._queue.put(_END)
        for child in self.children:
            child.end()

    def fail(self, error: BaseException) -> None:
        """Record an error (first one wins); queued nodes are skipped from now on."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def get_var(self, name: str) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: self._pending[name] == 0 or self.error is not None)
            if self.error is not None:
                raise self.error
            if name not in self.variables:
                raise KeyError(f"no variable {name!r} in this program state")
            return self.variables[name]

    def set_var(self, name: str, value: Any, meta: Any = None) -> None:
        with self._cond:
            self.variables[name] = value
            self.assigned.add(name)
            if meta is not None:
                self.meta_info[name] = meta
            self._cond.notify_all()

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        with self._cond:
            return self.meta_info.get(name)

    def current_meta(self, name: str) -> Any:
        """The meta info of `name` so far (while it streams: as of its latest piece)."""
        with self._cond:
            return self.meta_info.get(name)

    def has_var(self, name: str) -> bool:
        with self._cond:
            return name in self.variables or self._pending[name] > 0

    def fork(self, size: int) -> list[Executor]:
        """New executors continuing from this state's current text (waits for it first, then
        has the backend cache that text, so every branch's first request hits the cache)."""
        self.sync()
        if self.error is not None:
            raise self.error
        if size > 0:
            self.backend.cache_prefix(self._prompt())
        children = []
        for _ in range(int(size)):
            child = Executor(self.backend, self.defaults, self.stream)
            child.text_ = self.text_
            child.messages_ = [dict(m) for m in self.messages_]
            child.variables = {k: list(v) if isinstance(v, list) else v for k, v in self.variables.items()}
            child.meta_info = dict(self.meta_info)
            child.role, child.role_start = self.role, self.role_start
            child.scope_starts = dict(self.scope_starts)
            child.fork_start = len(self.text_)
            children.append(child)
        self.children.extend(children)
        return children

    def iter_text(self, name: str | None = None) -> Iterator[str]:
        """Pieces of the state text (name=None) or of one variable, as they are produced."""
        sent = 0
        while True:
            with self._cond:
                self._cond.wait_for(functools.partial(self._stream_ready, name, sent))
                current, done = self._stream_view(name)
                piece, sent = current[sent:], len(current)
            if piece:
                yield piece
            if done:
                return

    def _stream_ready(self, name: str | None, sent: int) -> bool:
        current, done = self._stream_view(name)
        return done or len(current) > sent

    def _stream_view(self, name: str | None) -> tuple[str, bool]:
        """(text so far, whether it is final); raises the state's error once it has one."""
        if self.error is not None:
            raise self.error
        if name is None:
            return self.text_, self.finished
        value = self.variables.get(name, "")
        final = self._pending[name] == 0 and (name in self.variables or self.finished)
        if final and name not in self.variables:
            raise KeyError(f"no variable {name!r} in this program state")
        return (value if isinstance(value, str) else str(value)), final

    # --- the worker thread -------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    with self._cond:
                        self.finished = True
                        self._cond.notify_all()
                    return
                if self.error is None:
                    self._execute(expr)
            except Exception as e:  # the program's error, reported to its readers
                self.fail(e)
            finally:
                self._queue.task_done()

    def _execute(self, expr: Expr) -> None:
        handler = self._dispatch.get(type(expr))
        if handler is None:
            raise TypeError(f"unknown IR node {type(expr).__name__}")
        handler(expr)

    def _append(self, text: str, generated: bool = False) -> None:
        if self.spec is not None and not generated:  # program text: match it against a speculation
            self.spec.fill(text)
        with self._cond:
            self.text_ += text
            self._cond.notify_all()

    def _produce(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            self.assigned.add(name)
            self._pending[name] -= 1
            self._cond.notify_all()

    def _prompt(self) -> Prompt:
        with self._cond:
            role_text = self.text_[self.role_start:] if self.role is not None else ""
            return Prompt(self.text_, tuple(dict(m) for m in self.messages_), self.role, role_text)

    # --- handlers (one per IR node type) -----------------------------------------------------
    def _in_chat_speculation(self) -> bool:
        return self.spec_chat is not None and self.role == "assistant"

    def _constant(self, expr: Constant) -> None:
        if self._in_chat_speculation():
            self.spec_chat.fill(expr.value)
            return
        self._append(expr.value)

    def _expr_list(self, expr: ExprList) -> None:
        for child in expr.exprs:
            self._execute(child)

    def _gen(self, expr: Gen) -> None:
        params = self.defaults.override(expr.params)
        if self.role is not None:
            params = params.with_stops(*self.backend.role_stops(self.role))
        if self._in_chat_speculation():
            if self.stream:
                raise NotImplementedError("stream=True is not supported with API speculative execution")
            self.spec_chat.gen(expr.name, params)
            return
        prompt = self._prompt()
        if not self.stream:
            if self.spec is not None:
                out = self.spec.gen(self.backend, prompt, params)
            else:
                out = self.backend.generate(prompt, params)
            self._append(out.text, generated=True)
            self._produce(expr.name, out.text, out.meta_info)
            return
        value, meta = "", {}
        for piece, piece_meta in self.backend.generate_stream(prompt, params):
            meta = piece_meta
            with self._cond:
                value += piece
                self.text_ += piece
                if expr.name is not None:
                    self.variables[expr.name] = value
                    self.meta_info[expr.name] = meta
                self._cond.notify_all()
        self._produce(expr.name, value, meta)

    def _select(self, expr: Select) -> None:
        if self._in_chat_speculation() and self.spec_chat.items:
            raise NotImplementedError("select after text or gen inside an assistant turn is not supported "
                                      "with API speculative execution on a chat model")
        decision = self.backend.select(self._prompt(), list(expr.choices), expr.temperature,
                                       expr.choices_method)
        self._append(decision.decision)
        self._produce(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, expr: RoleBegin) -> None:
        if self.role is not None:
            raise RuntimeError(f"cannot begin a {expr.role!r} role inside a {self.role!r} role: "
                               "roles do not nest")
        begin = self.backend.chat_template.begin(expr.role, first=not self.messages_)
        self._append(begin)
        with self._cond:
            self.role, self.role_start = expr.role, len(self.text_)

    def _role_end(self, expr: RoleEnd) -> None:
        if self.role != expr.role:
            raise RuntimeError(f"cannot end a {expr.role!r} role: the open role is {self.role!r}")
        if self._in_chat_speculation():  # one call writes the turn; fill in its texts and variables
            for item, text in self.spec_chat.run(self.backend, self._prompt()):
                self._append(text)
                if item.text is None:
                    self._produce(item.name, text, {"speculative": True})
        with self._cond:
            self.messages_.append({"role": expr.role, "content": self.text_[self.role_start:]})
            self.role = None
        self._append(self.backend.chat_template.end(expr.role))

    def _var_scope_begin(self, expr: VarScopeBegin) -> None:
        self.scope_starts[expr.name] = len(self.text_)

    def _var_scope_end(self, expr: VarScopeEnd) -> None:
        if expr.name not in self.scope_starts:
            raise RuntimeError(f"var_scope {expr.name!r} ended without beginning")
        self._produce(expr.name, self.text_[self.scope_starts.pop(expr.name):], None)

    def _concat_and_append(self, expr: ConcatAndAppend) -> None:
        pieces = []
        for child in expr.executors:
            child.sync()
            if child.error is not None:
                raise child.error
            pieces.append(child.text_[child.fork_start:])
        self._append("".join(pieces))
