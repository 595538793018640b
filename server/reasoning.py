"""A reasoning model's output split into its thinking and its answer (`--reasoning-parser`).

`ThinkingSplit` reads the output as it is decoded and emits `{"reasoning_content": ...}` and
`{"content": ...}` deltas; the whole answer is the same reader fed the whole text (`split`). What it
emits for a text is a prefix of what it emits for any longer text (a tag cut between chunks is held
back until it is whole), so streamed deltas concatenate to the whole answer's fields byte for byte.
Rules, the same for both:
- a format that is not forced thinks only when the output opens with the start tag (whitespace
  before it aside); otherwise the whole output is content. A forced one is thinking from the first
  character, its start tag optional (the chat template may have written it);
- whitespace at the start and end of the thinking, and right after the end tag, is dropped;
- an output that ends inside the thinking (its budget ran out) has reasoning and no content:
  `open` says so.
"""

from __future__ import annotations

from typing import Any

from radixlm.runtime.request.reasoning import ReasoningFormat

_WS = " \t\r\n"


class ThinkingSplit:
    def __init__(self, fmt: ReasoningFormat, stream: bool = True):
        """`stream` false (SGLang's stream_reasoning=false): the thinking comes out in one piece when
        it ends (its end tag, or the end of the output), not as it is decoded."""
        self.fmt = fmt
        self.stream = stream
        self.state = "start"  # start -> thinking -> after -> content, or start -> content
        self._held = ""
        self._thought = False  # some reasoning text was emitted (leading whitespace is dropped before it)
        self._thinking = ""  # the thinking so far, while it is not streamed

    @property
    def open(self) -> bool:
        """The output so far ends inside the thinking."""
        return self.state == "thinking" or self.state == "start" and self.fmt.forced

    def feed(self, delta: str) -> list[dict[str, str]]:
        text, self._held = self._held + delta, ""
        out: list[dict[str, str]] = []
        while text:
            if self.state == "start":
                body = text.lstrip(_WS)
                start = self.fmt.start
                if not body or (start.startswith(body) and body != start):
                    self._held = text  # maybe the start tag, not whole yet
                    break
                if body.startswith(start):
                    self.state, text = "thinking", body[len(start):]
                else:
                    self.state = "thinking" if self.fmt.forced else "content"
            elif self.state == "thinking":
                end = text.find(self.fmt.end)
                if end >= 0:
                    self._think(text[:end].rstrip(_WS), out)
                    self._release(out)
                    self.state, text = "after", text[end + len(self.fmt.end):]
                    continue
                keep = _partial_tag(text, self.fmt.end)
                head = text[:len(text) - keep]
                ready = head.rstrip(_WS)  # trailing whitespace waits: it is dropped if the end tag follows
                self._think(ready, out)
                self._held = text[len(ready):]
                break
            elif self.state == "after":
                text = text.lstrip(_WS)
                if text:
                    self.state = "content"
            else:
                _add(out, "content", text)
                break
        return out

    def finish(self) -> list[dict[str, str]]:
        """What was held back, at the end of the output."""
        text, self._held = self._held, ""
        out: list[dict[str, str]] = []
        if self.state == "start" and text:
            if self.fmt.forced:
                self._think(text.strip(_WS), out)
            else:
                _add(out, "content", text)
        elif self.state == "thinking":
            self._think(text.rstrip(_WS), out)
        self._release(out)
        return out

    def _think(self, text: str, out: list[dict[str, str]]) -> None:
        if not self._thought:
            text = text.lstrip(_WS)
        if text:
            self._thought = True
            if self.stream:
                _add(out, "reasoning_content", text)
            else:
                self._thinking += text

    def _release(self, out: list[dict[str, str]]) -> None:
        """The thinking held back while it is not streamed, once it has ended."""
        if self._thinking:
            _add(out, "reasoning_content", self._thinking)
            self._thinking = ""


def thinking_format(chat, tm) -> ReasoningFormat | None:
    """The format of the thinking a chat request's answer starts with: the server's --reasoning-parser,
    unless the request turns thinking off (chat_template_kwargs.enable_thinking, which the template
    also reads). The answer separates it unless the request asks for it inline (SGLang's
    separate_reasoning=false); a constraint waits for its end either way."""
    if tm.reasoning is None or (chat.chat_template_kwargs or {}).get("enable_thinking", True) is False:
        return None
    return tm.reasoning


def wait_for_thinking(reqs: list, fmt: ReasoningFormat | None, tm) -> None:
    """The requests' constraint judges only the answer: each grammar sleeps while the model thinks
    (runtime/request/reasoning.py). Nothing to do without a format, or where a tag is several tokens."""
    if fmt is None or tm.thinking_tokens is None:
        return
    for req in reqs:
        req.after_thinking = (*tm.thinking_tokens, fmt.forced)


def with_calls(pieces: list[dict[str, str]], parser: Any) -> list[dict]:
    """Reasoning deltas as they are; content through the tool-call parser (tool_stream.CallParser),
    if the request has tools."""
    deltas: list[dict] = []
    for piece in pieces:
        if parser is None or "content" not in piece:
            deltas.append(piece)
        else:
            deltas += parser.feed(piece["content"])
    return deltas


def split(text: str, fmt: ReasoningFormat) -> tuple[str | None, str, bool]:
    """(reasoning or None, content, ended inside the thinking) of a whole output."""
    parser = ThinkingSplit(fmt)
    parts = {"reasoning_content": "", "content": ""}
    for delta in parser.feed(text) + parser.finish():
        for key, value in delta.items():
            parts[key] += value
    return parts["reasoning_content"] or None, parts["content"], parser.open


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _add(out: list[dict[str, str]], key: str, text: str) -> None:
    if out and key in out[-1]:
        out[-1][key] += text
    else:
        out.append({key: text})
