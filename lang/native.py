"""Generate and select over the native generate API (the Engine's, also served as POST /generate).

Subclasses provide the transport (`_generate_raw`, same arguments and result shape as
`Engine.generate`, `streams_incrementally`) and, when they can, a tokenizer (`tokenize`) matching the runtime's.

`s.fork(n)` first sends the state text as a prefill-only request (`cache_prefix`), so every
branch's first request finds the shared prefix in the radix cache.

How `select` scores choices (one batched prefill-only request over the cached prefix):
  1. prefix alone, max_new_tokens=0: caches the prefix and reports its token count L.
  2. one call with prompts [prefix + choice_i], max_new_tokens=0, return_logprob=True and a
     per-prompt logprob_start_len at the first token that belongs to choice_i. The prefix's last
     token may merge with the choice's first characters ("is " + "Paris" -> "is", " Paris"), so
     the start is where the tokenizations of prefix and prefix+choice first differ.
     Without a tokenizer (RuntimeEndpoint with none given), the start is L-1 and that position is
     kept as part of a choice only if the choices disagree there (a merge happened).
  3. unconditional_likelihood_normalized only: the choices' tokens alone (after BOS, when the
     tokenizer has one), to score them without the prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixlm.lang.backend import Backend, BackendError, GenOutput, Prompt
from radixlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod, apply_temperature
from radixlm.lang.global_config import global_config
from radixlm.lang.ir import GenParams

_PREFILL_ONLY = {"max_new_tokens": 0}


def _check(result: dict) -> dict:
    finish = (result.get("meta_info") or {}).get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise BackendError(f"request aborted: {finish.get('message', 'no message')}")
    return result


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class NativeBackend(Backend):
    """Shared logic of EngineBackend and RuntimeEndpoint."""

    # --- transport, provided by subclasses ------------------------------------------------
    def _generate_raw(self, prompt: str | list[str] | None = None, sampling_params: Any = None,
                      input_ids: Any = None, return_logprob: Any = False, logprob_start_len: Any = -1,
                      top_logprobs_num: Any = 0, stream: bool = False, return_text_in_logprobs: bool = False) -> Any:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int] | None:
        """Token ids of `text` as the runtime tokenizes a prompt, or None when unknown."""
        return None

    def bos_token_id(self) -> int | None:
        return None

    # --- generate -------------------------------------------------------------------------
    def decode_token(self, token_id: int) -> str | None:
        """The text of one token (for return_text_in_logprobs), or None when unknown."""
        return None

    def _request_args(self, prompt: Prompt, params: GenParams) -> dict[str, Any]:
        sampling = params.sampling_params()
        # SGLang sends these two with every gen; only a change from the runtime's default matters
        if not global_config.skip_special_tokens_in_output:
            sampling["skip_special_tokens"] = False
        if not global_config.spaces_between_special_tokens_in_out:
            sampling["spaces_between_special_tokens"] = False
        args: dict[str, Any] = {"prompt": prompt.text, "sampling_params": sampling}
        if params.return_logprob:
            args["return_logprob"] = True
            args["logprob_start_len"] = -1 if params.logprob_start_len is None else params.logprob_start_len
            args["top_logprobs_num"] = params.top_logprobs_num or 0
            if params.return_text_in_logprobs:
                args["return_text_in_logprobs"] = True
        return args

    def _with_text(self, meta: dict, params: GenParams) -> dict:
        """return_text_in_logprobs: entries (logprob, token_id, text) get the token's text where
        the transport left it out (the Engine returns ids only)."""
        if not (params.return_logprob and params.return_text_in_logprobs):
            return meta
        fix = lambda e: (e[0], e[1], e[2] if len(e) > 2 and e[2] is not None else self.decode_token(int(e[1])))
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if meta.get(key):
                meta[key] = [fix(e) for e in meta[key]]
        if meta.get("output_top_logprobs"):
            meta["output_top_logprobs"] = [[fix(e) for e in row] if row else row for row in meta["output_top_logprobs"]]
        return meta

    def generate(self, prompt: Prompt, params: GenParams) -> GenOutput:
        result = _check(self._generate_raw(**self._request_args(prompt, params)))
        return GenOutput(result["text"], self._with_text(result.get("meta_info", {}), params))

    def streams_incrementally(self) -> bool:
        """Whether the runtime's streamed chunks carry their new text only (its
        incremental_streaming_output) rather than the text so far (SGLang's default)."""
        return False

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[tuple[str, dict]]:
        """Each chunk's new text and the meta_info so far."""
        incremental, seen = self.streams_incrementally(), 0
        for chunk in self._generate_raw(**self._request_args(prompt, params), stream=True):
            _check(chunk)
            text = chunk.get("text", "")
            if not incremental:
                text, seen = text[seen:], len(text)
            yield text, self._with_text(chunk.get("meta_info", {}), params)

    def cache_prefix(self, prompt: Prompt) -> None:
        if prompt.text:
            _check(self._generate_raw(prompt=prompt.text, sampling_params=dict(_PREFILL_ONLY)))

    # --- select ---------------------------------------------------------------------------
    def select(self, prompt: Prompt, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        prefix = prompt.text
        head = _check(self._generate_raw(prompt=prefix, sampling_params=dict(_PREFILL_ONLY)))
        prefix_len = int(head["meta_info"]["prompt_tokens"])

        starts, counts = self._choice_spans(prefix, choices, prefix_len)
        results = self._generate_raw(
            prompt=[prefix + c for c in choices],
            sampling_params=[dict(_PREFILL_ONLY) for _ in choices],
            return_logprob=True,
            logprob_start_len=starts,
            top_logprobs_num=0,
        )
        scored = [list(_check(r)["meta_info"]["input_token_logprobs"]) for r in results]
        if counts is None:
            counts = self._counts_without_tokenizer(scored)
        input_lps = [
            [tuple(e) for e in lps[max(len(lps) - n, 0):] if e[0] is not None]
            for lps, n in zip(scored, counts, strict=True)
        ]
        for choice, lps in zip(choices, input_lps, strict=True):
            if not lps:
                raise BackendError(f"select: no scorable tokens for choice {choice!r}")
        normalized = [sum(e[0] for e in lps) / len(lps) for lps in input_lps]

        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            unconditional = self._unconditional(input_lps)
        decision = choices_method(
            choices=list(choices),
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=input_lps,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=unconditional,
        )
        return apply_temperature(decision, list(choices), temperature)

    def _choice_spans(self, prefix: str, choices: list[str],
                      prefix_len: int) -> tuple[list[int], list[int] | None]:
        """Per choice: logprob_start_len, and how many trailing prompt tokens are the choice's
        (None when unknown: no tokenizer, decided after scoring)."""
        prefix_ids = self.tokenize(prefix)
        if prefix_ids is None:
            return [max(prefix_len - 1, 0)] * len(choices), None
        offset = prefix_len - len(prefix_ids)  # a BOS the runtime adds and our tokenize didn't
        starts, counts = [], []
        for choice in choices:
            ids = self.tokenize(prefix + choice) or []
            shared = min(_common_prefix_len(prefix_ids, ids), max(len(ids) - 1, 0))
            starts.append(max(shared + offset, 0))
            counts.append(len(ids) - shared)
        return starts, counts

    @staticmethod
    def _counts_without_tokenizer(scored: list[list]) -> list[int]:
        """Scored from position L-1: that position is the prefix's last token unless the choices
        tokenized it differently (its last characters merged into the choice)."""
        drop_first = len({lps[0][1] for lps in scored if lps}) == 1
        return [max(len(lps) - 1, 1) if drop_first and len(lps) > 1 else len(lps) for lps in scored]

    def _unconditional(self, input_lps: list[list[tuple]]) -> list[list[tuple]]:
        bos = self.bos_token_id()
        lead = [bos] if bos is not None else []
        token_ids = [lead + [int(e[1]) for e in lps] for lps in input_lps]
        results = self._generate_raw(
            input_ids=token_ids,
            sampling_params=[dict(_PREFILL_ONLY) for _ in token_ids],
            return_logprob=True,
            logprob_start_len=[0] * len(token_ids),
            top_logprobs_num=0,
        )
        out = []
        for lps, result in zip(input_lps, results, strict=True):
            entries = list(_check(result)["meta_info"]["input_token_logprobs"])
            out.append([tuple(e) for e in entries[max(len(entries) - len(lps), 0):]])
        return out
