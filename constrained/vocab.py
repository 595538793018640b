"""The bytes each token stands for, read from a Hugging Face tokenizer.

Grammar engines match bytes, while tokenizers store tokens in an encoded form:
- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen): every byte is mapped to a printable unicode
  character (``Ġ`` for a space, ``Ċ`` for a newline), so the token string is decoded char by char;
- SentencePiece (Llama 2, Mistral): ``▁`` stands for a space and ``<0xAB>`` for a raw byte;
- added tokens (``added_tokens_decoder``) are stored as plain text.
Special (control) tokens have no text: they map to None and are never allowed by a grammar.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def special_token_ids(tokenizer: Any) -> set[int]:
    """Control tokens: the tokenizer's special tokens and added tokens flagged special."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes | None]:
    """``out[i]`` = the bytes token ``i`` decodes to, or None for special and unused ids."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    added = {int(i): a for i, a in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    special = special_token_ids(tokenizer)
    u2b = _unicode_to_byte()
    base = [s for s, i in vocab.items() if i not in added]
    byte_level = all(c in u2b for s in base for c in s) and any("Ġ" in s or "Ċ" in s for s in base)
    out: list[bytes | None] = [None] * vocab_size
    for text, i in vocab.items():
        if i >= vocab_size or i in special:
            continue
        if i in added:
            out[i] = added[i].content.encode()
        elif byte_level:
            out[i] = bytes(u2b[c] for c in text)
        else:
            m = _SP_BYTE.match(text)
            out[i] = bytes([int(m.group(1), 16)]) if m else text.replace("▁", " ").encode()
    return out
