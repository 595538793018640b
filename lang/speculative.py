"""API speculative execution (`@function(num_api_spec_tokens=N)`), SGLang's two forms.

Completion interfaces (every backend but an OpenAI chat model), CompletionSpeculation: at an
unconstrained gen with a stop string, ask for N tokens (or the gen's max_tokens if larger) with no
stop strings. The gen takes the text up to its first stop; the rest is kept, and the program's
next constant text is matched against it (and consumed) and the next gen is answered from it
the same way, so "Q: " + gen(stop="\n") + "\nA: " + gen(stop="\n") can cost one call. Text that does
not match drops the speculation. Where SGLang would cut a gen whose stop never appears at
max_tokens *characters*, RadixLM makes a normal call for that gen instead (same result as
without speculation); a speculation that ended with a stop token answers a gen whose stop
string never appears with all of its remaining text (a normal call would have stopped there too).

Chat interfaces (OpenAI chat models), ChatSpeculation: inside an assistant turn, constants and
gens are collected instead of run; at the end of the turn one chat completion of N tokens
writes the whole message, and it is matched against them: each constant must appear verbatim,
each gen takes the text up to its stop (the last one: the rest). Up to 3 tries; if none matches,
the program fails with an error saying so (SGLang leaves the variables empty instead).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from radixlm.lang.backend import Backend, BackendError, GenOutput, Prompt
from radixlm.lang.ir import GenParams

CHAT_TRIES = 3


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    found = [(text.find(s), s) for s in stops if s and text.find(s) >= 0]
    return min(found) if found else None


class CompletionSpeculation:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = int(num_tokens)
        self.text = ""  # speculated continuation not yet used by the program
        self.ended = False  # the speculation stopped on its own (EOS or a stop token), not at length
        self.meta: dict[str, Any] = {}
        self.calls = 0

    def fill(self, value: str) -> None:
        """The program appended ``value``: consume it from the speculation, or drop it."""
        if value and self.text.startswith(value):
            self.text = self.text[len(value):]
        elif value:
            self.text, self.ended = "", False

    def gen(self, backend: Backend, prompt: Prompt, params: GenParams) -> GenOutput:
        constrained = params.regex is not None or params.json_schema is not None or params.dtype is not None
        if constrained or not params.stop or params.return_logprob:
            self.text, self.ended = "", False
            return backend.generate(prompt, params)
        if not self.text and not self.ended:
            self._speculate(backend, prompt, params)
        hit = _first_stop(self.text, params.stop)
        if hit is not None:
            value, self.text = self.text[:hit[0]], self.text[hit[0]:]
            return GenOutput(value, dict(self.meta, speculative=True))
        if self.ended:  # a normal call would also have stopped where the speculation did
            value, self.text, self.ended = self.text, "", False
            return GenOutput(value, dict(self.meta, speculative=True))
        self.text = ""
        return backend.generate(prompt, params)

    def _speculate(self, backend: Backend, prompt: Prompt, params: GenParams) -> None:
        ahead = dataclasses.replace(params, stop=None, max_new_tokens=max(params.max_new_tokens or 0, self.num_tokens))
        out = backend.generate(prompt, ahead)
        self.calls += 1
        finish = (out.meta_info or {}).get("finish_reason") or {}
        self.text, self.meta = out.text, dict(out.meta_info or {})
        self.ended = isinstance(finish, dict) and finish.get("type") == "stop"


@dataclass
class _Item:
    text: str | None  # a constant's text, or None for a gen
    name: str | None = None
    params: GenParams | None = None


class ChatSpeculation:
    """Collects one assistant turn (see the module docstring)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = int(num_tokens)
        self.items: list[_Item] = []

    def fill(self, value: str) -> None:
        if value:
            self.items.append(_Item(value))

    def gen(self, name: str | None, params: GenParams) -> None:
        if params.regex is not None or params.json_schema is not None or params.dtype is not None:
            raise NotImplementedError("API speculative execution on a chat model cannot constrain a gen "
                                      "(regex, json_schema, dtype) inside an assistant turn")
        self.items.append(_Item(None, name, params))

    def run(self, backend: Any, prompt: Prompt) -> list[tuple[_Item, str]]:
        """One chat completion for the turn, matched against the collected items."""
        items, self.items = self.items, []
        gens = [i for i in items if i.text is None]
        if not gens:
            return [(i, i.text) for i in items]
        params = dataclasses.replace(gens[0].params, stop=None, max_new_tokens=self.num_tokens)
        answers = []
        for _ in range(CHAT_TRIES):
            answer = backend.generate(prompt, params).text
            values = match(items, answer)
            if values is not None:
                return list(zip(items, values))
            answers.append(answer)
        raise BackendError(
            f"API speculative execution: none of {CHAT_TRIES} answers followed the program's fixed text "
            f"{[i.text for i in items if i.text is not None]!r}; last answer: {answers[-1][:200]!r}")


def match(items: list[_Item], answer: str) -> list[str] | None:
    """The text of each item in ``answer`` (constants verbatim, gens up to their stop), or None."""
    out, rest = [], answer
    for k, item in enumerate(items):
        if item.text is not None:
            if not rest.startswith(item.text):
                return None
            out.append(item.text)
            rest = rest[len(item.text):]
            continue
        hit = _first_stop(rest, list(item.params.stop or []))
        if hit is None and k != len(items) - 1:
            return None
        cut = len(rest) if hit is None else hit[0]
        out.append(rest[:cut])
        rest = rest[cut:]
    return out
