"""Reasoning models' thinking blocks: the formats `--reasoning-parser` names, and the grammar that holds
a request's constraint back while the model thinks.

A reasoning model (Qwen3, DeepSeek-R1 and its distills) writes `<think>...</think>` before its answer.
The server splits the thinking off (server/reasoning.py). A constraint (`response_format`, a tool
grammar) judges only the answer: `AfterThinking` lets the model think freely and hands every token
after the end of the thinking to the request's grammar. Until then it allows every token but the
stop tokens, so a constrained request cannot end without an answer; the budget (`max_tokens`) can.

The start and end of a thinking block are one token each in these models' vocabularies (added
special tokens), which is what the grammar watches for (`thinking_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from radixlm.constrained.base import Grammar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    # the output starts inside the thinking (the chat template opened it, or the model always
    # thinks): text before the end is reasoning even without a start tag
    forced: bool


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", forced=False),
    "qwen3-thinking": ReasoningFormat("qwen3-thinking", "<think>", "</think>", forced=True),  # 2507 thinking models
    "deepseek-r1": ReasoningFormat("deepseek-r1", "<think>", "</think>", forced=True),
}


def thinking_tokens(tokenizer, fmt: ReasoningFormat) -> tuple[int, int] | None:
    """(start id, end id) when the tokenizer spells each tag as one token, else None."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (fmt.start, fmt.end)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


class AfterThinking(Grammar):
    """The request's grammar (`inner`), asleep while the model thinks.

    Forced formats think from the first token; others think only if the first token opens a block
    (it is allowed beside what the inner grammar allows, and the model chooses). Tokens of the
    thinking, the end token included, never reach the inner grammar."""

    __slots__ = ("inner", "start_id", "end_id", "forced", "stop_ids", "state", "_asleep_steps", "_inner_steps")

    def __init__(self, inner: Grammar, start_id: int, end_id: int, forced: bool, stop_ids: tuple[int, ...]):
        self.inner = inner
        self.start_id, self.end_id, self.forced, self.stop_ids = start_id, end_id, forced, tuple(stop_ids)
        self.state = "thinking" if forced else "first"  # first -> thinking | awake; thinking -> awake
        self._asleep_steps = 0  # tokens taken before the inner grammar woke (rolled back last)
        self._inner_steps = 0

    @property
    def error_message(self) -> str | None:
        return getattr(self.inner, "error_message", None)

    def pending_check(self):
        pending = getattr(self.inner, "pending_check", None)
        return pending() if pending is not None and self.state == "awake" else None

    def batch_target(self) -> Grammar | None:
        return self.inner.batch_target() if self.state == "awake" else None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.state == "awake":
            self.inner.fill_mask(bitmask, row)
            return
        if self.state == "first":
            self.inner.fill_mask(bitmask, row)
            _set(bitmask, row, self.start_id, True)
            return
        bitmask[row].fill_(-1)
        for token in self.stop_ids:  # thinking: no answer yet, so no end
            _set(bitmask, row, token, False)

    def accept(self, token_id: int) -> bool:
        if self.state == "awake" or self.state == "first" and token_id != self.start_id:
            if not self.inner.accept(token_id):
                return False
            self.state = "awake"
            self._inner_steps += 1
            return True
        if self.state == "first":
            self.state = "thinking"
        elif token_id == self.end_id:
            self.state = "awake"
        elif token_id in self.stop_ids:
            return False
        self._asleep_steps += 1
        return True

    def is_terminated(self) -> bool:
        return self.state == "awake" and self.inner.is_terminated()

    def jump_forward(self) -> str | None:
        return self.inner.jump_forward() if self.state == "awake" else None

    def accept_string(self, text: str) -> bool:
        if self.state != "awake" or not self.inner.accept_string(text):
            return False
        self._inner_steps += 1
        return True

    def rollback(self, k: int) -> None:
        inner = min(k, self._inner_steps)
        if inner:
            self.inner.rollback(inner)
            self._inner_steps -= inner
        rest = k - inner
        if rest:  # back into (or before) the thinking
            self._asleep_steps -= rest
            self.state = "thinking" if self._asleep_steps > 0 or self.forced else "first"
        elif not self._inner_steps and not self._asleep_steps and not self.forced:
            self.state = "first"  # an answer's first token undone: it may open a thinking block again

    def copy(self) -> Grammar:
        twin = AfterThinking(self.inner.copy(), self.start_id, self.end_id, self.forced, self.stop_ids)
        twin.state, twin._asleep_steps, twin._inner_steps = self.state, self._asleep_steps, self._inner_steps
        return twin


def _set(bitmask: torch.Tensor, row: int, token: int, allowed: bool) -> None:
    """One token's bit in a packed int32 bitmask row."""
    word, bit = divmod(token, 32)
    if word >= bitmask.shape[1]:
        return
    value = int(bitmask[row, word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
