"""A tokenizer's `decode` without transformers: the fast tokenizer's own Rust object, rebuilt from its
JSON, decodes as transformers' `decode` does.

The server's detokenizer process only decodes, and transformers' import and the Python tables its
tokenizer builds cost a process start-up time and memory (benchmarks/README.md, "Server start-up and
memory"). The HTTP process, which loads transformers' tokenizer anyway, hands
the detokenizer the JSON of the Rust tokenizer that tokenizer decodes with (`decoder_spec`), added
and special tokens included. Where transformers' decode does more than the Rust decode (a tokenizer
class with its own decode, spaces cleaned up after it) or differs on a probe, there is no spec and the
detokenizer loads transformers' tokenizer as before.
"""

from __future__ import annotations

from typing import Any

# text whose ids, with every special token's, are decoded both ways before a spec is handed out
_PROBE = "Hello , world . It 's 3.5% — naïve 日本語 café!\n\t  spaced ?! <tag> {\"a\": [1, 2]}"


class PlainDecoder:
    """What the detokenizer reads of a tokenizer: `decode(ids, skip_special_tokens)`."""

    def __init__(self, spec: str):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(spec)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def decoder_spec(tokenizer: Any) -> str | None:
    """The JSON a PlainDecoder decodes exactly as `tokenizer.decode` with, or None where it would not."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or kind.decode is not PreTrainedTokenizerBase.decode \
            or kind._decode is not TokenizersBackend._decode:
        return None
    try:
        spec = tokenizer.backend_tokenizer.to_str()
        plain = PlainDecoder(spec)
        ids = list(tokenizer.encode(_PROBE, add_special_tokens=False)) + list(tokenizer.all_special_ids)
        ids += list(range(min(len(tokenizer), 512)))
    except Exception:  # a tokenizer this cannot read: transformers' own decode then
        return None
    for skip in (False, True):
        for part in (ids, ids[:7], ids[-40:]):
            if plain.decode(part, skip_special_tokens=skip) != tokenizer.decode(part, skip_special_tokens=skip):
                return None
    return spec
