"""Tool calls as they form: a chat output in the formats of tool_calls.py, read incrementally into
the deltas OpenAI streams (content; each call's id and name with `arguments: ""`; then argument
fragments as the model writes them).

One parser serves both answers: the non-streamed one is the same parser fed the whole text
(`split`). What the parser emits for a text is a prefix of what it emits for any longer text, so
the fragments of a streamed call concatenate to the non-streamed call byte for byte, however the
output was cut into chunks. Rules, the same for both answers:
- arguments are the model's own JSON text (the `arguments` value as written, not re-serialized);
- "auto": text outside `<tool_call>` blocks is content. Whitespace at its end is held until more
  content follows (so content before and after calls carries no trailing whitespace), and
  whitespace before the first content is dropped when a call came first. A block that is not a
  call of a known tool stays content, as written. With no call at all the content is the output;
- "required": a JSON array of `{"name", "arguments"}` objects, or one object; an output with no
  call in it is content;
- a named tool: the whole output (whitespace around it dropped) is that tool's arguments;
- a call cut short (max_tokens) stays a call with the arguments written so far, as OpenAI streams
  it; the finish reason then says "length".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from radixlm.server.tool_calls import BARE_OPEN, HERMES, ToolCall, ToolFormat

_WS = " \t\r\n"


class ObjectScan:
    """The top-level members of one JSON object in a growing text, scanned a character at a time
    from `pos`: each member as [key, value start, value end] (end None while it is being written).
    `state` ends "done" after the closing brace (`end` is the index after it) or "bad" at anything
    that is not JSON. Nested values are skipped by depth, never recursed into."""

    def __init__(self, start: int):
        self.pos = start
        self.state = "open"
        self.members: list[list[Any]] = []
        self.end: int | None = None
        self._key_start = 0
        self._kind = ""  # the value being read: "nest" (object or array), "str", "scalar"
        self._depth = 0
        self._in_str = False
        self._esc = False

    @property
    def closed(self) -> bool:
        return self.state in ("done", "bad")

    def member(self, key: str) -> list[Any] | None:
        return next((m for m in self.members if m[0] == key), None)

    def scan(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and not self.closed:
            c = text[i]
            if self.state == "value":
                if not self._value_char(c, i):
                    continue  # a scalar ended before c: c is read again as what follows it
            elif self.state == "key":
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    try:
                        self.members.append([json.loads(text[self._key_start:i + 1]), None, None])
                        self.state = "colon"
                    except ValueError:
                        self.state = "bad"
            elif c not in _WS:
                self._structural(c, i)
            i += 1
        self.pos = i

    def _structural(self, c: str, i: int) -> None:
        state = self.state
        if state == "open":
            self.state = "first_key" if c == "{" else "bad"
        elif state in ("first_key", "next_key") and c == '"':
            self.state, self._key_start = "key", i
        elif state == "first_key" and c == "}" or state == "after" and c == "}":
            self.state, self.end = "done", i + 1
        elif state == "colon":
            self.state = "value_start" if c == ":" else "bad"
        elif state == "value_start":
            self.members[-1][1] = i
            self._kind = "nest" if c in "{[" else "str" if c == '"' else "scalar"
            self._depth, self._in_str, self._esc = (1 if c in "{[" else 0), False, False
            self.state = "value"
        elif state == "after" and c == ",":
            self.state = "next_key"
        else:
            self.state = "bad"

    def _value_char(self, c: str, i: int) -> bool:
        """Reads c inside a value; False when a scalar ended just before c (c not consumed)."""
        if self._kind == "scalar":
            if c in _WS or c in ",}":
                self._end_value(i)
                return False
            return True
        if self._kind == "str" and i == self.members[-1][1]:
            return True  # the opening quote
        if self._esc:
            self._esc = False
        elif c == "\\" and (self._in_str or self._kind == "str"):
            self._esc = True
        elif c == '"':
            if self._kind == "str":
                self._end_value(i + 1)
            else:
                self._in_str = not self._in_str
        elif not self._in_str and self._kind == "nest":
            self._depth += 1 if c in "{[" else -1 if c in "}]" else 0
            if self._depth == 0:
                self._end_value(i + 1)
        return True

    def _end_value(self, end: int) -> None:
        self.members[-1][2] = end
        self.state = "after"


@dataclass(slots=True)
class _Block:
    """One call object being read: its scan, and the call once its name is known."""

    opened: int  # auto: where its `<tool_call>` starts
    scan: ObjectScan | None = None
    call: ToolCall | None = None
    index: int = -1
    sent: int = 0  # characters of its arguments already emitted


@dataclass(slots=True)
class CallParser:
    """Content and tool-call deltas of one chat output for a tool choice ("auto", "required" or
    a named tool, as tool_calls.constraint): `feed` each text delta, then `finish` once."""

    tools: list[dict]
    choice: str | dict
    fmt: ToolFormat = HERMES
    text: str = ""
    content: str = ""  # all content emitted
    calls: list[ToolCall] = field(default_factory=list)
    _pos: int = 0
    _held: str = ""  # auto: whitespace at the end of the content so far
    _block: _Block | None = None
    _array: bool | None = None  # required: the output is an array (None: not known yet)
    _ended: bool = False  # required: nothing more is read
    _list: str = ""  # auto, mistral: "" outside a call list, "open" after its opener, "items" inside the array

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        return self._run(final=False)

    def finish(self) -> list[dict]:
        """The deltas of the rest of the output (text held back to see what it was)."""
        out = self._run(final=True)
        if isinstance(self.choice, dict) or self.calls:
            return out
        rest = self._held if self.choice == "auto" else self.text  # no call: the output is content
        if rest:
            self.content += rest
            out.append({"content": rest})
        self._held = ""
        return out

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def _run(self, final: bool) -> list[dict]:
        if isinstance(self.choice, dict):
            return self._named()
        if self.choice != "auto":
            return self._required(final)
        if self.fmt.array:
            return self._auto_list(final)
        return self._auto_bare(final) if not self.fmt.open else self._auto(final)

    # ------------------------------------------------------------------- the three formats
    def _named(self) -> list[dict]:
        out = []
        if self._block is None:
            self._block = _Block(0)
            out.append(self._open(self._block, self.choice["function"]["name"]))
        start = len(self.text) - len(self.text.lstrip(_WS))
        args = self.text[start:].rstrip(_WS)
        return out + self._send(self._block, args)

    def _auto(self, final: bool) -> list[dict]:
        out: list[dict] = []
        text = self.text
        while True:
            b = self._block
            if b is None:
                if self._find_opener(self.fmt.open, final, out) is None:
                    return out
                self._block = _Block(self._pos)
                self._pos += len(self.fmt.open)
                continue
            if b.scan is None:
                start = _skip_ws(text, self._pos)
                if start == len(text) and not final:
                    return out
                if start == len(text) or text[start] != "{":
                    out += self._not_a_call(b)
                    continue
                b.scan = ObjectScan(start)
            deltas = self._read_call(b, final)
            if deltas is None:
                out += self._not_a_call(b)
                continue
            out += deltas
            if not b.scan.closed:
                return out
            close = text.find(self.fmt.close, b.scan.pos)
            if close < 0:
                return out
            self._pos, self._block = close + len(self.fmt.close), None

    def _auto_bare(self, final: bool) -> list[dict]:
        """llama3: a call is a JSON object with a name and parameters, wherever it starts."""
        out: list[dict] = []
        text = self.text
        while True:
            b = self._block
            if b is None:
                if self._find_opener(BARE_OPEN, final, out) is None:
                    return out
                b = self._block = _Block(self._pos, ObjectScan(self._pos))
            deltas = self._read_call(b, final)
            if deltas is None:  # not a call: its brace is content, and reading goes on after it
                self._pos, self._block = b.opened + 1, None
                out += self._content(text[b.opened])
                continue
            out += deltas
            if not b.scan.closed:
                return out
            self._pos, self._block = b.scan.end or b.scan.pos, None

    def _auto_list(self, final: bool) -> list[dict]:
        """mistral: the opener, then a JSON array of call objects."""
        out: list[dict] = []
        text = self.text
        while True:
            b = self._block
            if b is None and not self._list:
                if self._find_opener(self.fmt.open, final, out) is None:
                    return out
                self._list, self._pos = "open", self._pos + len(self.fmt.open)
                continue
            if b is None:
                at = _skip_ws(text, self._pos)
                if at == len(text):
                    if final and self._list == "open":  # a bare opener: content
                        self._list = ""
                        out += self._content(self.fmt.open)
                    return out
                c = text[at]
                if self._list == "open":
                    if c != "[":
                        self._list = ""
                        out += self._content(self.fmt.open)
                        continue
                    self._list, self._pos = "items", at + 1
                    continue
                if c == "," or c == "]":
                    self._pos = at + 1
                    self._list = "items" if c == "," else ""
                    continue
                if c != "{":  # the list ends here; what follows is content
                    self._list, self._pos = "", at
                    continue
                b = self._block = _Block(at, ObjectScan(at))
            deltas = self._read_call(b, final)
            if deltas is None:  # not a call: the list ends, and the object is content
                self._list, self._block, self._pos = "", None, b.opened
                out += self._content(text[b.opened])
                self._pos += 1
                continue
            out += deltas
            if not b.scan.closed:
                return out
            self._pos, self._block = b.scan.end or b.scan.pos, None

    def _find_opener(self, marker: str, final: bool, out: list[dict]) -> int | None:
        """Moves to the next `marker`, emitting the content before it; None when there is none yet
        (the content is emitted up to where the marker could still begin)."""
        text = self.text
        at = text.find(marker, self._pos)
        if at < 0:
            safe = len(text) if final else len(text) - _partial_suffix(text, marker, self._pos)
            out += self._content(text[self._pos:safe])
            self._pos = safe
            return None
        out += self._content(text[self._pos:at])
        self._pos = at
        return at

    def _required(self, final: bool) -> list[dict]:
        out: list[dict] = []
        text = self.text
        while not self._ended:
            b = self._block
            if b is None:
                at = _skip_ws(text, self._pos)
                if at == len(text):
                    break
                c = text[at]
                if self._array is None and c in "[{":
                    self._array = c == "["
                    self._pos = at + (c == "[")
                    continue
                if self._array and c == "," and self.calls:
                    self._pos = at + 1
                    continue
                if c != "{" or (not self._array and self.calls):
                    self._ended = True  # "]", or anything not a call: the calls so far are the answer
                    break
                b = self._block = _Block(at, ObjectScan(at))
            deltas = self._read_call(b, final)
            if deltas is None:
                self._ended = True
                break
            out += deltas
            if not b.scan.closed:
                break
            self._pos, self._block = b.scan.end or b.scan.pos, None
            if b.scan.state == "bad":
                self._ended = True
        return out

    # ------------------------------------------------------------------- shared parts
    def _read_call(self, b: _Block, final: bool) -> list[dict] | None:
        """Scans a call object further: its header once the name is known, then new arguments;
        None when it is not a call of a known tool."""
        text, scan = self.text, b.scan
        scan.scan(text)
        out = []
        if b.call is None:
            name = scan.member("name")
            if scan.state == "bad" or (name is None or name[2] is None) and scan.closed:
                return None
            if name is None or name[2] is None:
                return []
            try:
                value = json.loads(text[name[1]:name[2]])
            except ValueError:
                return None
            if not isinstance(value, str) or value not in self.names:
                return None
            out.append(self._open(b, value))
        return out + self._send(b, _arguments(scan, text, final, self.fmt.args_key))

    def _open(self, b: _Block, name: str) -> dict:
        b.call, b.index = ToolCall(name, ""), len(self.calls)
        self.calls.append(b.call)
        return {"tool_calls": [{"index": b.index, "id": b.call.id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _send(self, b: _Block, args: str) -> list[dict]:
        if len(args) <= b.sent:
            return []
        fragment, b.sent = args[b.sent:], len(args)
        b.call.arguments += fragment
        return [{"tool_calls": [{"index": b.index, "function": {"arguments": fragment}}]}]

    def _not_a_call(self, b: _Block) -> list[dict]:
        """An auto block that is no call: its opener is content, and reading goes on after it."""
        self._pos, self._block = b.opened + len(self.fmt.open), None
        return self._content(self.fmt.open)

    def _content(self, piece: str) -> list[dict]:
        if not piece:
            return []
        text = self._held + piece
        body = text.rstrip(_WS)
        self._held = text[len(body):]
        if body and not self.content and self.calls:
            body = body.lstrip(_WS)
        if not body:
            return []
        self.content += body
        return [{"content": body}]


def _arguments(scan: ObjectScan, text: str, final: bool, key: str = "arguments") -> str:
    """The arguments text so far: an object or array value as written (growing as it is written);
    a JSON string's content, or another value, once complete; "{}" for a call with none. `key` is
    the format's member for them; the other common spelling is read too."""
    member = scan.member(key) or scan.member("parameters" if key == "arguments" else "arguments")
    if member is None or member[1] is None:
        return "{}" if scan.state == "done" else ""
    start, end = member[1], member[2]
    if text[start] in "{[":
        return text[start:len(text) if end is None else end]
    if end is None:
        return text[start:] if final and text[start] != '"' else ""
    raw = text[start:end]
    if raw.startswith('"'):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """Length of the longest end of text[start:] that could be the beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split(text: str, tools: list[dict], choice: str | dict,
          fmt: ToolFormat = HERMES) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output: exactly what streaming it delivers."""
    parser = CallParser(tools, choice, fmt)
    parser.feed(text)
    parser.finish()
    return parser.content or (None if parser.calls else parser.content), parser.calls


def legacy_delta(delta: dict) -> dict | None:
    """A tool_calls delta in the legacy `function_call` shape (the first call only: legacy
    functions make one call); other deltas as they are."""
    calls = delta.get("tool_calls")
    if calls is None:
        return delta
    call = calls[0]
    return {"function_call": dict(call["function"])} if call["index"] == 0 else None
