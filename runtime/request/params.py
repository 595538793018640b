"""Per-request sampling parameters, with SGLang's field names.

Validation lives in ``__post_init__``: every invalid value raises a RequestError naming the field,
so the Engine, the server and the DSL all report the same error for the same mistake. Integers are
bounded to 64 bits (they cross a process boundary as msgpack) and floats must be finite.

Strict about values, liberal about names (``from_dict``): every name SGLang's SamplingParams
defines is accepted. Those that cannot change RadixLM's answer are ignored with a debug log;
those RadixLM cannot serve are accepted only at their no-op value (null).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import regex as rx  # re-compatible; its searches take a timeout (stop_regex runs per step)

from radixlm.runtime.request.errors import RequestError

logger = logging.getLogger(__name__)

# Constraint kinds understood by radixlm.constrained; at most one per request.
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")
INT64_MAX = 2**63 - 1
SEED_BITS = 64
MAX_STOP_REGEX = 16
MAX_STOP_REGEX_CHARS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # ids allowed_token_ids may list (a vocabulary holds far fewer)
MAX_BAD_WORDS = 128  # bad_words: words, and characters each (tokenized on the scheduler's thread)
MAX_BAD_WORD_CHARS = 128
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
# SGLang names that never change RadixLM's answer (accepted, ignored with a debug log).
IGNORED_FIELDS = {
    # transformers' fast tokenizers (the only kind RadixLM loads) have no such decode option
    "spaces_between_special_tokens": "fast tokenizers decode without it",
    "stream_interval": "RadixLM streams every step",
    # read only by a custom_logit_processor, which RadixLM never runs
    "custom_params": "no custom logit processor runs",
}
# SGLang names RadixLM cannot serve: accepted only while they ask for nothing.
UNSUPPORTED_FIELDS = {"beam_width": (None, 1), "watermark": (None,)}


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0  # stop ids / EOS / stop strings cannot end the output before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)  # the output ends once one matches its tail
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's [-100, 100])
    regex: str | None = None
    json_schema: str | None = None  # a dict is accepted and serialized to a JSON string
    ebnf: str | None = None
    structural_tag: str | None = None
    token_healing: bool = False  # back off the prompt's last token (runtime/request/healing.py)
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens are sampled (request/token_rules.py)
    bad_words: list[str] | None = None  # vLLM's: words the output never completes (request/token_rules.py)

    def __post_init__(self) -> None:
        self.stop = _str_list("stop", self.stop)
        self.stop_regex = _str_list("stop_regex", self.stop_regex)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_int("min_new_tokens", self.min_new_tokens, low=0, high=self.max_new_tokens)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True, high=2.0)
        _check_int("n", self.n, low=1, high=128)
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "token_healing"):
            if not isinstance(getattr(self, name), bool):
                raise _error(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.sampling_seed is not None:
            # any 64-bit pattern is a seed; negative ones (some clients send them) wrap around
            _check_int("sampling_seed", self.sampling_seed, low=-(2 ** (SEED_BITS - 1)), high=2**SEED_BITS - 1)
            self.sampling_seed %= 2**SEED_BITS
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in self.stop_token_ids
        ):
            raise _error("stop_token_ids", "must be a list of non-negative integers")
        self._check_stop_regex()
        self._check_logit_bias()
        self._check_allowed_token_ids()
        self._check_bad_words()
        rules = [name for name in ("allowed_token_ids", "bad_words") if getattr(self, name)]
        if rules and self.token_healing:  # healing's first token is chosen by its own mask, which knows no rules
            raise _error(rules[0], "cannot be combined with token_healing")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise _error(given[1], f"cannot be combined with {given[0]}: only one of "
                                   f"{', '.join(CONSTRAINT_FIELDS)} may be set")
        for name in given:
            if not isinstance(getattr(self, name), str):
                raise _error(name, "must be a string")

    def _check_stop_regex(self) -> None:
        if len(self.stop_regex) > MAX_STOP_REGEX:
            raise _error("stop_regex", f"has {len(self.stop_regex)} patterns, the limit is {MAX_STOP_REGEX}")
        for pattern in self.stop_regex:
            if len(pattern) > MAX_STOP_REGEX_CHARS:
                raise _error("stop_regex", f"pattern is {len(pattern)} characters, the limit is {MAX_STOP_REGEX_CHARS}")
            try:
                rx.compile(pattern)
            except (rx.error, RecursionError, OverflowError) as e:
                raise _error("stop_regex", f"{pattern!r} is not a valid regular expression: {e}") from e

    def _check_allowed_token_ids(self) -> None:
        ids = self.allowed_token_ids
        if ids is None:
            return
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in ids):
            raise _error("allowed_token_ids", "must be a non-empty list of token ids (non-negative integers)")
        if len(ids) > MAX_ALLOWED_TOKEN_IDS:
            raise _error("allowed_token_ids", f"lists {len(ids)} ids, the limit is {MAX_ALLOWED_TOKEN_IDS}")

    def _check_bad_words(self) -> None:
        words = self.bad_words
        if words is None:
            return
        if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
            raise _error("bad_words", "must be a list of non-blank strings")
        if len(words) > MAX_BAD_WORDS:
            raise _error("bad_words", f"has {len(words)} words, the limit is {MAX_BAD_WORDS}")
        if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
            raise _error("bad_words", f"holds a word longer than {MAX_BAD_WORD_CHARS} characters")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise _error("logit_bias", "must be an object mapping token ids to numbers")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = _token_key(key)
            if token is None:
                raise _error("logit_bias", f"keys must be token ids (non-negative integers), got {key!r}")
            _check_number("logit_bias", value, low=-LOGIT_BIAS_LIMIT, high=LOGIT_BIAS_LIMIT)
            bias[token] = float(value)
        self.logit_bias = bias or None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalty: sampling reads the token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the grammar constraint, if any."""
        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        """Build from a request dict. Null means "the default"; a name SGLang defines is accepted
        (see IGNORED_FIELDS, UNSUPPORTED_FIELDS); any other name is a RequestError naming it."""
        if data is None:
            return cls()
        if isinstance(data, SamplingParams):
            return data
        if not isinstance(data, dict):
            raise RequestError("sampling_params", f"must be an object, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in _FIELD_NAMES:
                if value is not None:
                    kwargs[key] = value
            elif key in IGNORED_FIELDS:
                logger.debug("ignoring sampling_params.%s (%s)", key, IGNORED_FIELDS[key])
            elif key in UNSUPPORTED_FIELDS:
                if value not in UNSUPPORTED_FIELDS[key]:
                    raise _error(key, f"is not supported by RadixLM (got {value!r}); leave it unset")
            else:
                raise _error(key, "is not a sampling parameter (unknown field)")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _error(name: str, problem: str) -> RequestError:
    return RequestError(name, problem, section="sampling_params")


def _str_list(name: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise _error(name, "must be a non-empty string or a list of non-empty strings")
    return list(value)


def _token_key(key: Any) -> int | None:
    if isinstance(key, int) and not isinstance(key, bool):
        token = key
    elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18:
        token = int(key)
    else:
        return None
    return token if 0 <= token <= INT64_MAX else None


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _error(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise _error(name, f"must be >= {low}, got {value}")
    high = INT64_MAX if high is None else high
    if value > high:
        raise _error(name, f"must be <= {high}, got {value}")


def _check_number(
    name: str, value: Any, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (
        isinstance(value, float) and not math.isfinite(value)
    ):
        raise _error(name, f"must be a finite number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise _error(name, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise _error(name, f"must be <= {high}, got {value}")
