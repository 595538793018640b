"""Chat request -> prompt token ids, with the client's text kept as text.

The chat template's own markup (`<|im_start|>user\\n ... <|im_end|>`) must become control tokens;
the same characters typed by a client in a message (or a tool description, a tool call's
arguments, a chat_template_kwargs value) must not, or a user could forge a system turn. Rendering
to text and tokenizing the whole text cannot tell the two apart, so when some client string holds
the text of a special token:

  1. each such string is replaced by a unique sentinel and the conversation is rendered again:
     what lies between the sentinels is the template's (`pieces`);
  2. each sentinel is matched to the form in which the real rendering wrote its string (as is,
     trimmed or JSON-escaped by the template: `_align`);
  3. special tokens are recognised in the template's pieces only; the text between two of them,
     the client's strings included, is tokenized with special tokens split (`_tokenize`).

Requests whose strings hold no special-token text keep the plain path (render, tokenize), which
gives the same ids (tests/test_server_security_roles.py checks both on SmolLM2).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.request.builder import undouble_bos
from radixlm.server.errors import APIError
from radixlm.server.openai_convert import chat_template_args, render_chat
from radixlm.server.openai_models import ChatCompletionRequest


@dataclass(frozen=True, slots=True)
class Specials:
    """A tokenizer's special tokens (those split_special_tokens leaves as text) and its framing."""
    pattern: re.Pattern | None  # any special token's text (longest first); None: the tokenizer has none
    ids: dict[str, int]  # text -> id
    lstrip: frozenset[str]  # tokens that swallow the whitespace before them (AddedToken.lstrip)
    rstrip: frozenset[str]  # ... and after them
    prefix: tuple[int, ...]  # what tokenizer(text) adds around the text's own ids (BOS, ...)
    suffix: tuple[int, ...]

    def found_in(self, text: str) -> bool:
        return self.pattern is not None and self.pattern.search(text) is not None


@functools.lru_cache(maxsize=8)
def specials_of(tokenizer: Any) -> Specials:
    added = [(tid, tok) for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()
             if tok.special and tok.content]
    texts = sorted({tok.content for _, tok in added}, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
    plain = tokenizer("a", add_special_tokens=False).input_ids
    framed = tokenizer("a").input_ids
    at = next((i for i in range(len(framed) - len(plain) + 1) if framed[i:i + len(plain)] == plain), 0)
    return Specials(pattern, {tok.content: tid for tid, tok in added},
                    frozenset(tok.content for _, tok in added if tok.lstrip),
                    frozenset(tok.content for _, tok in added if tok.rstrip),
                    tuple(framed[:at]), tuple(framed[at + len(plain):]))


def sanitize_wanted(asked: bool | None, allowed: bool) -> bool:
    """Whether a request's content is tokenized as text: its `sanitize_control_tokens`, else the
    server's default (sanitized unless --allow-control-tokens-in-content)."""
    if asked is False and not allowed:
        raise APIError(400, "sanitize_control_tokens=false needs a server started with "
                            "--allow-control-tokens-in-content", param="sanitize_control_tokens")
    return not allowed if asked is None else asked


def chat_ids(req: ChatCompletionRequest, builder: Any, tools: list[dict] | None, sanitize: bool,
             fmt: Any = None) -> list[int]:
    """The prompt ids of a chat request (builder: the RequestBuilder, which owns the tokenizer);
    with `sanitize`, special-token text in the client's strings is tokenized as plain text."""
    tokenizer = builder.tokenizer
    messages, kwargs = chat_template_args(req, tokenizer, tools, *([fmt] if fmt is not None else []))
    text = render_chat(tokenizer, messages, kwargs)
    specials = specials_of(tokenizer)
    if not sanitize or not any(specials.found_in(s) for s in _strings([messages, kwargs])):
        return builder.tokenize(text)
    builder.check_chars(text, "messages")
    return sanitized_ids(tokenizer, specials, messages, kwargs, text)


def sanitized_ids(tokenizer: Any, specials: Specials, messages: list[dict], kwargs: dict[str, Any],
                  rendered: str) -> list[int]:
    """Steps 1-3 of the module docstring; `rendered` is the conversation's real rendering."""
    tag = f"zq{secrets.token_hex(8)}n"  # letters and digits only: survives trim, tojson, escaping
    values: list[str] = []
    masked_messages, masked_kwargs = _mask([messages, kwargs], specials, tag, values)
    skeleton = render_chat(tokenizer, masked_messages, masked_kwargs)
    parts = re.split(f"{tag}(\\d+)z", skeleton)
    pieces, order = parts[0::2], [values[int(i)] for i in parts[1::2]]
    contents = _align(rendered, pieces, order)
    ids = [*specials.prefix, *_tokenize(tokenizer, specials, pieces, contents), *specials.suffix]
    return undouble_bos(tokenizer, rendered, ids)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _mask(value: Any, specials: Specials, tag: str, values: list[str]) -> Any:
    """`value` with each string (keys too) holding special-token text replaced by a sentinel;
    the originals are appended to `values` (sentinel i stands for values[i])."""
    if isinstance(value, str):
        if not specials.found_in(value):
            return value
        values.append(value)
        return f"{tag}{len(values) - 1}z"
    if isinstance(value, dict):
        return {_mask(k, specials, tag, values): _mask(v, specials, tag, values) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mask(v, specials, tag, values) for v in value]
    return value


def _forms(value: str) -> dict[str, None]:
    """How a template may write a string: as is, trimmed, JSON-escaped (tojson)."""
    return dict.fromkeys([value, value.strip(), value.lstrip(), value.rstrip(),
                          json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(value)[1:-1]])


def _align(rendered: str, pieces: list[str], values: list[str]) -> list[str]:
    """The text the real rendering has in place of each sentinel; the values as given when the
    rendering does not match piece by piece (a template that looks into the content itself)."""
    pos = len(pieces[0]) if rendered.startswith(pieces[0]) else -1
    found: list[str] = []
    for value, after in zip(values, pieces[1:], strict=True):
        form = next((f for f in _forms(value) if pos >= 0 and rendered.startswith(f + after, pos)), None)
        if form is None:
            return values
        found.append(form)
        pos += len(form) + len(after)
    return found if pos == len(rendered) else values


def _tokenize(tokenizer: Any, specials: Specials, pieces: list[str], contents: list[str]) -> list[int]:
    """Special tokens found in the template's pieces become their ids; every run of text between
    two of them (client contents included) is tokenized with special tokens split."""
    ids: list[int] = []
    run: list[str] = []
    strip_next = False

    def flush(lstrip: bool) -> None:  # lstrip/rstrip: the whitespace HF's tokenizer lets a token swallow
        text = "".join(run)
        run.clear()
        text = text.lstrip() if strip_next else text
        text = text.rstrip() if lstrip else text
        if text:
            ids.extend(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    for i, piece in enumerate(pieces):
        start = 0
        for m in specials.pattern.finditer(piece):
            run.append(piece[start:m.start()])
            flush(m.group() in specials.lstrip)
            ids.append(specials.ids[m.group()])
            strip_next, start = m.group() in specials.rstrip, m.end()
        run.append(piece[start:])
        if i < len(contents):
            run.append(contents[i])
    flush(False)
    return ids
