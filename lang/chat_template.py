"""Role begin/end strings derived from a model's own chat template.

A role block appends `begin + content + end` to the state text. To make the text equal, byte for
byte, what the template renders for `s.messages()`, the strings are not hard-coded per model:
they are measured by rendering probe conversations and splitting at sentinel contents.

- `first_begin(role)`: the begin string when the message is the conversation's first one. It
  includes whatever the template injects before a first message, e.g. SmolLM2's default system
  prompt when the first message is not a system message.
- `begin(role)`: the begin string of a later message (probe: a short conversation + role).
- `end(role)`: what follows the content.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text

_PROBE = ("RadixLMProbeAlpha", "RadixLMProbeBravo", "RadixLMProbeCharlie")


@dataclass(frozen=True, slots=True)
class RoleFormat:
    first_begin: str
    begin: str
    end: str


def _split(text: str, sentinel: str, role: str) -> tuple[str, str]:
    at = text.find(sentinel)
    if at < 0:
        raise ValueError(f"the chat template does not render the content of a {role!r} message")
    return text[:at], text[at + len(sentinel):]


class ChatTemplate:
    """Role formats of one chat template, measured lazily per role and cached."""

    def __init__(self, render: Render, tokenizer: Any = None) -> None:
        self._render = render
        self._tokenizer = tokenizer
        self._formats: dict[str, RoleFormat] = {}
        self._stop_ids: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._render(messages, add_generation_prompt)

    def role_format(self, role: str) -> RoleFormat:
        with self._lock:
            if role not in self._formats:
                self._formats[role] = self._measure(role)
            return self._formats[role]

    def begin(self, role: str, first: bool) -> str:
        fmt = self.role_format(role)
        return fmt.first_begin if first else fmt.begin

    def end(self, role: str) -> str:
        return self.role_format(role).end

    def get_prefix_and_suffix(self, role: str, hist_messages: list[dict]) -> tuple[str, str]:
        """SGLang's ChatTemplate method: a `role` message's begin and end strings after
        `hist_messages` (the first message's begin carries what the template puts first)."""
        return self.begin(role, first=not hist_messages), self.end(role)

    def stop_strings(self, role: str) -> list[str]:
        """Stop strings for a gen inside a `role` block: the end marker (e.g. "<|im_end|>")."""
        marker = self.end(role).strip()
        return [marker] if marker else []

    def stop_token_ids(self, role: str) -> list[int]:
        """The end marker's token id when it is a single token (special tokens are usually
        hidden from the output text, so a stop string alone would never match)."""
        with self._lock:
            cached = self._stop_ids.get(role)
        if cached is not None:
            return cached
        ids: list[int] = []
        markers = self.stop_strings(role)
        if markers and self._tokenizer is not None:
            encoded = self._tokenizer.encode(markers[0], add_special_tokens=False)
            if len(encoded) == 1 and self._tokenizer.decode(encoded) == markers[0]:
                ids = [int(encoded[0])]
        with self._lock:
            self._stop_ids[role] = ids
        return ids

    def _measure(self, role: str) -> RoleFormat:
        alpha, bravo, probe = _PROBE
        first_begin, end = _split(self._render([{"role": role, "content": probe}], False), probe, role)
        if role == "assistant":
            before = [{"role": "user", "content": alpha}]
        else:
            before = [{"role": "user", "content": alpha}, {"role": "assistant", "content": bravo}]
        last = before[-1]["content"]
        try:
            head = self._render(before, False)
            full = self._render([*before, {"role": role, "content": probe}], False)
        except Exception:  # the template rejects this order (e.g. a late system message)
            return RoleFormat(first_begin, first_begin, end)
        head_tail = head[head.index(last) + len(last):]
        between = full[full.index(last) + len(last): full.find(probe)]
        begin = between[len(head_tail):] if between.startswith(head_tail) else between
        return RoleFormat(first_begin, begin, end)


def chatml_render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """A plain ChatML rendering, for backends that cannot show their real template (OpenAI)."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
