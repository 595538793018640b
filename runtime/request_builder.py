"""Turns Engine.generate arguments into validated Reqs, and StepOutputs back into result dicts.

Shared by the Engine and the server's TokenizerManager, so both accept and reject exactly the
same inputs with the same messages.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, replace
from typing import Any

from radixlm.runtime.core import Req, StepOutput
from radixlm.runtime.detokenizer import IncrementalDetokenizer
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.runtime.token_healing import healed_text

_ids = itertools.count()


def new_rid() -> str:
    return f"{uuid.uuid4().hex[:12]}{next(_ids)}"


class RequestResult:
    """Accumulates a request's StepOutputs into SGLang-shaped result dicts."""

    def __init__(self, req: Req, tokenizer):
        self.rid = req.rid
        p = req.params
        self.detok = IncrementalDetokenizer(tokenizer, p.stop, p.skip_special_tokens, p.no_stop_trim,
                                            strip_prefix=healed_text(req.input_ids, p, tokenizer))
        self.return_logprob = req.return_logprob
        self.output_ids: list[int] = []
        self.input_logprobs: list = []
        self.output_logprobs: list = []
        self.output_top_logprobs: list = []
        self.last: StepOutput | None = None

    def add(self, step: StepOutput) -> dict[str, Any]:
        """Takes one step's output; returns the stream chunk (new text and ids since the last one)."""
        self.last = step
        self.output_ids += step.new_ids
        if step.input_logprobs:
            self.input_logprobs = [(lp, tid, None) for lp, tid in step.input_logprobs]
        if step.output_logprobs:
            self.output_logprobs += [(lp, tid, None) for lp, tid in step.output_logprobs]
        if step.output_top_logprobs:
            self.output_top_logprobs += [[(lp, tid, None) for lp, tid in row] for row in step.output_top_logprobs]
        delta = self.detok.add(step.new_ids, step.finish)
        return {"text": delta, "output_ids": list(step.new_ids), "meta_info": self._meta()}

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.detok.text, "output_ids": self.output_ids, "meta_info": self._meta()}

    def _meta(self) -> dict[str, Any]:
        logprobs = (self.input_logprobs, self.output_logprobs, self.output_top_logprobs)
        return base_meta(self.rid, self.last, logprobs if self.return_logprob else None)


def base_meta(rid: str, step, logprobs: tuple[list, list, list] | None) -> dict[str, Any]:
    """SGLang's meta_info from the latest step output (anything with StepOutput's count fields);
    `logprobs` = (input, output, output top) lists when the request asked for them."""
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": step.prompt_tokens,
        "completion_tokens": step.completion_tokens,
        "cached_tokens": step.cached_tokens,
        "finish_reason": step.finish.to_dict() if step.finish else None,
        "jump_forward_tokens": step.jump_forward_tokens,
    }
    if logprobs is not None:
        meta["input_token_logprobs"], meta["output_token_logprobs"], meta["output_top_logprobs"] = logprobs
    return meta


@dataclass(slots=True)
class BuiltBatch:
    groups: list[list[tuple[Req, RequestResult]]]  # one group per prompt; n samples in a group
    is_batch: bool


class RequestBuilder:
    def __init__(self, tokenizer, vocab_size: int, context_len: int, pool_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.pool_size = pool_size

    @classmethod
    def from_runner(cls, runner) -> RequestBuilder:
        return cls(runner.tokenizer, runner.vocab_size, runner.context_len, runner.allocator.num_slots)

    def build(self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
              top_logprobs_num, stream, rid) -> BuiltBatch:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            texts = prompt if is_batch else [prompt]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a non-empty list of strings")
            token_lists = [self.tokenize(t) for t in texts]
        else:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            token_lists = input_ids if is_batch else [input_ids]
            for ids in token_lists:
                self.check_ids(ids)
        n = len(token_lists)
        params = _per_item("sampling_params", sampling_params, n)
        lp = _per_item("return_logprob", return_logprob, n)
        starts = _per_item("logprob_start_len", logprob_start_len, n)
        tops = _per_item("top_logprobs_num", top_logprobs_num, n)
        rids = _per_item("rid", rid, n)
        groups = []
        for i, ids in enumerate(token_lists):
            sp = SamplingParams.from_dict(params[i])
            self.check_length(ids, sp)
            if tops[i] is not None and not 0 <= tops[i] <= 20:
                raise ValueError(f"top_logprobs_num must be between 0 and 20, got {tops[i]}")
            base = rids[i] or new_rid()
            group = []
            for k in range(sp.n):
                p = sp if sp.n == 1 else replace(
                    sp, n=1, sampling_seed=None if sp.sampling_seed is None else sp.sampling_seed + k)
                req = Req(
                    rid=base if sp.n == 1 else f"{base}-{k}",
                    input_ids=list(ids),
                    params=p,
                    return_logprob=bool(lp[i]),
                    logprob_start_len=starts[i] if starts[i] is not None else -1,
                    top_logprobs_num=tops[i] or 0,
                    stream=stream,
                )
                group.append((req, RequestResult(req, self.tokenizer)))
            groups.append(group)
        return BuiltBatch(groups, is_batch)

    def tokenize(self, text: str) -> list[int]:
        if not text:
            raise ValueError("prompt is empty")
        ids = self.tokenizer(text).input_ids
        bos = self.tokenizer.bos_token
        # chat templates often write the BOS text themselves; don't double it
        if bos and text.startswith(bos) and len(ids) > 1 and ids[0] == ids[1] == self.tokenizer.bos_token_id:
            ids = ids[1:]
        return ids

    def check_ids(self, ids: Any) -> None:
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"input_ids contains {t!r}, not a token id in [0, {self.vocab_size})")

    def check_length(self, ids: list[int], sp: SamplingParams) -> None:
        if len(ids) >= self.context_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, the context length is {self.context_len} "
                "(prompt must leave room for at least one new token)"
            )
        if len(ids) + 1 > self.pool_size:
            raise ValueError(f"prompt is {len(ids)} tokens, larger than the KV pool ({self.pool_size} tokens)")


def _per_item(name: str, value: Any, n: int) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} items for {n} prompts")
        return value
    return [value] * n
