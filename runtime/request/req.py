"""Central runtime types: the request as the scheduler sees it, finish reasons, step outputs.

Which stage fills what: the Engine/TokenizerManager builds a Req (ids, params, logprob options);
the scheduler fills the cache/KV fields while it runs and the output fields after each step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixlm.runtime.request.params import SamplingParams


@dataclass(slots=True, frozen=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    message: str | None = None  # why an abort happened
    code: int | None = None  # HTTP-style status of an abort: 400 = the request itself, 500 = it failed inside
    field: str | None = None  # the request field at fault, for such aborts (e.g. "regex", "stop_regex")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        return out


@dataclass(eq=False, slots=True)
class Req:
    # --- set by the caller
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position whose logprob is returned; -1 = none
    top_logprobs_num: int = 0
    stream: bool = False
    # (start id, end id, forced) of a reasoning model's thinking block: the constraint judges only what
    # follows it (request/reasoning.py); None: the constraint judges the whole output
    after_thinking: tuple[int, int, bool] | None = None
    # SGLang's token_ids_logprob: these ids' logprobs at every reported position (with return_logprob)
    token_ids_logprob: list[int] | None = None
    # --- scheduler: KV and cache state
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None  # row in ReqToTokenPool while it holds KV
    kv_len: int = 0  # tokens of input_ids + output_ids whose KV is in its row
    cached_len: int = 0  # leading tokens whose slots the radix cache owns (and this req locks)
    last_node: Any = None  # locked radix node covering the first cached_len tokens
    cached_tokens: int = 0  # prompt tokens served from the cache (reported in meta_info)
    grammar: Any = None
    healing: Any = None  # token_healing.TokenHealing when the prompt's last token was backed off
    token_history: Any = None  # sampling.penalties.TokenHistory of a request with penalties
    # --- scheduler: outputs
    finish: FinishReason | None = None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)  # top_logprobs_num > 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    sent_len: int = 0  # output tokens already streamed
    jump_forward_tokens: int = 0
    retractions: int = 0
    # a check of a client pattern (stop_regex, the schema's end check) still running on the pattern
    # pool: the request takes no step until it resolves (scheduler._resume_parked)
    parked: ParkedCheck | None = None
    pattern_seconds: float = 0.0  # time its stop_regex checks spent on the pattern pool (bounded)
    # --- timing (time.monotonic): set when queued, and when first admitted to a prefill
    queued_at: float = 0.0
    admitted_at: float | None = None
    # the prompt as a tuple (the radix cache's key type), made once for the list it was made from
    _prompt: tuple[int, ...] = ()
    _prompt_of: list[int] | None = None

    def prefix(self, end: int) -> tuple[int, ...]:
        """The first `end` tokens of prompt and output, as the radix cache takes them. Admission and
        the cache read a long prompt several times; this copies it into a tuple once, not each time."""
        if self._prompt_of is not self.input_ids:
            self._prompt, self._prompt_of = tuple(self.input_ids), self.input_ids
        prompt = self._prompt
        if end <= len(prompt):
            return prompt if end == len(prompt) else prompt[:end]
        return prompt + tuple(self.output_ids[: end - len(prompt)])

    def span(self, start: int, end: int) -> list[int]:
        """Tokens start..end of prompt and output, without copying the rest of either."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        # per-step checks use this: no token list is copied
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def token_ids_asked(self) -> list[int] | None:
        """The ids whose logprobs each position reports (token_ids_logprob, with return_logprob)."""
        return self.token_ids_logprob if self.return_logprob else None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and 0 <= self.logprob_start_len < len(self.input_ids)


@dataclass(slots=True)
class ParkedCheck:
    future: Any  # concurrent.futures.Future of the check
    # the check's result -> the request's finish (None: it goes on); a PatternTimeout it raised
    # is turned into a 400 by the scheduler
    resolve: Any
    source: str | None = None  # the request field whose patterns run (named by a timeout's 400)
    since: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class StepOutput:
    """What one scheduler step reports for one request (new tokens since the last report)."""

    rid: str
    new_ids: list[int]
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None  # token_ids_logprob
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None
    jump_forward_tokens: int = 0
    queue_time: float | None = None  # seconds from add_request to the first prefill (first report only)


@dataclass(slots=True)
class SchedulerStats:
    """Load figures sent with output batches (for /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    used_slots: int = 0  # held by running requests (evictable cache excluded)
    cached_slots: int = 0  # held only by the radix cache (evictable)
    total_slots: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    forward_passes: int = 0
    retractions: int = 0
