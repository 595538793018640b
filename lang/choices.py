"""How `select` turns per-token log-probabilities of each choice into a decision.

Every method is called with keyword arguments (SGLang's shape):
  choices                       the option strings
  normalized_prompt_logprobs    mean log-probability of each choice's tokens given the prefix
  input_token_logprobs          per choice, [(logprob, token_id, None), ...] of the choice's tokens
  output_token_logprobs         per choice, [] (select generates nothing)
  unconditional_token_logprobs  per choice, the same tokens scored without the prefix (only for
                                methods whose `requires_unconditional_logprobs` is True)
and returns a ChoicesDecision whose `meta_info` is what `s.get_meta_info(name)` shows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)
    scores: list[float] | None = None  # per choice, higher is better; used for temperature sampling


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


class ChoicesSamplingMethod:
    """Base class of the choice-scoring methods."""

    requires_unconditional_logprobs: bool = False

    def __call__(self, **kwargs: Any) -> ChoicesDecision:
        raise NotImplementedError

    @staticmethod
    def _meta(normalized: list[float], input_lps: list[list], output_lps: list[list]) -> dict[str, Any]:
        return {
            "normalized_prompt_logprobs": normalized,
            "input_token_logprobs": input_lps,
            "output_token_logprobs": output_lps,
        }


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Pick the choice with the highest mean token log-probability (the default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        best = _argmax(normalized_prompt_logprobs)
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[best], meta, list(normalized_prompt_logprobs))

    def __repr__(self) -> str:
        return "token_length_normalized"


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Pick by the first token's log-probability; break ties with the following tokens.

    Choices shorter than the longest one are padded with their own mean log-probability, so a
    choice that is a prefix of another competes fairly (SGLang's rule).
    """

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        width = max(len(option) for option in input_token_logprobs)
        matrix = []
        for option in input_token_logprobs:
            row = [entry[0] for entry in option]
            matrix.append(row + [_mean(row)] * (width - len(row)))
        remaining = list(range(len(choices)))
        for column in range(width):
            best = max(matrix[i][column] for i in remaining)
            remaining = [i for i in remaining if matrix[i][column] == best]
            if len(remaining) == 1:
                break
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[remaining[0]], meta, list(normalized_prompt_logprobs))

    def __repr__(self) -> str:
        return "greedy_token_selection"


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Pick the choice whose tokens gain the most from the prefix: mean of
    (logprob given the prefix - logprob given a neutral context). A missing unconditional
    log-probability (the very first token of a sequence has none) counts as 0."""

    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None) -> ChoicesDecision:
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional_token_logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs, strict=True):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional token logprobs differ in length")
            scores.append(_mean([c[0] - (u[0] or 0.0) for c, u in zip(cond, uncond, strict=True)]))
        meta = self._meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_argmax(scores)], meta, scores)

    def __repr__(self) -> str:
        return "unconditional_likelihood_normalized"


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def apply_temperature(decision: ChoicesDecision, choices: list[str], temperature: float,
                      rng: random.Random | None = None) -> ChoicesDecision:
    """With temperature > 0, sample the decision from softmax(scores / temperature)."""
    if temperature <= 0 or not decision.scores:
        return decision
    top = max(decision.scores)
    weights = [math.exp((s - top) / temperature) for s in decision.scores]
    picked = (rng or random).choices(range(len(choices)), weights=weights)[0]
    return ChoicesDecision(choices[picked], decision.meta_info, decision.scores)
