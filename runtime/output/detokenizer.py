"""Incremental detokenization with stop-string trimming, per request.

Text is emitted only once it is stable: a piece ending in an incomplete UTF-8 sequence waits for
the next token, and a suffix that could be the start of a stop string is held back, so a stream
never shows text that the final answer drops.
"""

from __future__ import annotations

from radixlm.runtime.request.req import FinishReason


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True, no_stop_trim: bool = False,
                 strip_prefix: str = "", incremental: bool = True):
        self.tokenizer = tokenizer
        # False: nobody reads text before the finish (a whole answer), which decodes every id anyway
        self.incremental = incremental
        # token healing: the output starts with text the prompt already has; it is left out
        self.strip_prefix = strip_prefix
        self._strip_pending = bool(strip_prefix)
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.ids: list[int] = []
        self.text = ""  # decoded so far (stable part)
        self.emitted = 0  # characters of self.text already handed out
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int], finish: FinishReason | None) -> str:
        """Feeds new tokens; returns the text that became final with them."""
        self.ids += new_ids
        if finish is not None:
            self.text = self._strip(self._decode(self.ids))
            # a stop string is cut off; a stop_regex match (matched = its pattern) stays, as in SGLang
            if finish.type == "stop" and finish.matched in self.stop and not self.no_stop_trim:
                cut = self.text.find(finish.matched)
                if cut >= 0:
                    self.text = self.text[:cut]
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        if not self.incremental:
            return ""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if self._strip_pending:
            if len(self.text) < len(self.strip_prefix):
                return ""  # the healed text is not complete yet
            self.text, self._strip_pending = self._strip(self.text), False
        safe = len(self.text) - self._held_back()
        if safe <= self.emitted:
            return ""
        out = self.text[self.emitted : safe]
        self.emitted = safe
        return out

    def _strip(self, text: str) -> str:
        prefix = self.strip_prefix
        return text[len(prefix):] if prefix and text.startswith(prefix) else text

    def _held_back(self) -> int:
        hold = 0
        for s in self.stop:
            for k in range(min(len(s), len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold
