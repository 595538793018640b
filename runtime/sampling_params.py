"""Per-request sampling parameters, with SGLang's field names.

Validation lives in ``__post_init__``: every invalid value raises a ValueError that names the
field, so the Engine, the server and the DSL all report the same message for the same mistake.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

# Constraint kinds understood by radixlm.constrained; at most one per request.
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) means the whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # a dict is accepted and serialized to a JSON string
    ebnf: str | None = None
    structural_tag: str | None = None
    token_healing: bool = False  # back off the prompt's last token (runtime/token_healing.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        _check_int("max_new_tokens", self.max_new_tokens, low=0)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True, high=2.0)
        _check_int("n", self.n, low=1, high=128)
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed, low=0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of {', '.join(CONSTRAINT_FIELDS)} may be set, got {given}")
        for name in given:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

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
        """Build from a request dict; an unknown key is a ValueError naming it (never ignored)."""
        if data is None:
            return cls()
        if isinstance(data, SamplingParams):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"sampling_params must be an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling_params field(s): {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if v is not None or k in CONSTRAINT_FIELDS})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_number(
    name: str, value: Any, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
