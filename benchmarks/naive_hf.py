"""The naive baseline of benchmarks/programs.py: a radixlm.lang Backend over transformers.

It runs a program the way a plain script would: one call at a time (a lock serializes them, even
fork branches), `model.generate` on the whole prompt for every gen, and for `select` one full
forward pass per choice. Nothing is shared between calls: no prefix cache, no batching. Grammar
constraints (regex / json_schema) use the same radixlm.constrained grammars as the runtime,
applied as a transformers LogitsProcessor, so every executor does the same work.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, StoppingCriteria

import radixlm.lang as rl
from radixlm.lang.choices import apply_temperature


class _StopStrings(StoppingCriteria):
    """Stop once the generated text (after `start`) contains one of `stops`."""

    def __init__(self, tokenizer: Any, stops: list[str], start: int) -> None:
        self.tokenizer, self.stops, self.start = tokenizer, stops, start
        self.window = max(len(s) for s in stops) + 4

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        tail = input_ids[0, max(self.start, input_ids.shape[1] - self.window):].tolist()
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return torch.tensor([any(s in text for s in self.stops)], device=input_ids.device)


class _GrammarMask(LogitsProcessor):
    """Feeds each new token to the grammar and masks the logits to what it allows next."""

    def __init__(self, grammar: Any, backend: Any, prompt_len: int) -> None:
        self.grammar, self.backend, self.prompt_len = grammar, backend, prompt_len
        self.bitmask = backend.allocate_bitmask(1)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_len:
            self.grammar.accept(int(input_ids[0, -1]))
        self.grammar.fill_mask(self.bitmask, 0)
        self.backend.apply_bitmask(scores, self.bitmask)
        return scores


class NaiveHFBackend(rl.Backend):
    def __init__(self, folder: str, device: str = "cpu") -> None:
        super().__init__()
        from radixlm.runtime.executor.loader import load_tokenizer

        self.tokenizer = load_tokenizer(folder)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(self.device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self._lock = threading.Lock()  # one call at a time
        self._grammars = None

    # --- helpers --------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def _grammar(self, kind: str, spec: str) -> Any:
        if self._grammars is None:
            from radixlm.constrained import create_grammar_backend

            self._grammars = create_grammar_backend("xgrammar", self.tokenizer, self.model.config.vocab_size)
        return self._grammars.compile(kind, spec)

    def _token_logprobs(self, ids: list[int], start: int) -> list[tuple]:
        """[(logprob, token, None)] of ids[start:] given what precedes each (a full forward pass)."""
        logits = self.model(torch.tensor([ids], device=self.device)).logits[0].float()
        logprobs = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
        targets = torch.tensor(ids[start:], device=self.device)
        values = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        return [(lp, t, None) for lp, t in zip(values, ids[start:], strict=True)]

    # --- Backend interface ----------------------------------------------------------------
    def generate(self, prompt: rl.Prompt, params: Any) -> rl.GenOutput:
        ids = self._ids(prompt.text)
        stops = list(params.stop or [])
        kwargs: dict[str, Any] = {"max_new_tokens": params.max_new_tokens or 128,
                                  "eos_token_id": [self.eos_id, *(params.stop_token_ids or [])],
                                  "pad_token_id": self.eos_id}
        temperature = 1.0 if params.temperature is None else params.temperature
        if temperature > 1e-5:
            kwargs.update(do_sample=True, temperature=temperature, top_p=params.top_p or 1.0,
                          top_k=params.top_k if params.top_k and params.top_k > 0 else None)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with self._lock, torch.inference_mode():
            if stops:
                kwargs["stopping_criteria"] = [_StopStrings(self.tokenizer, stops, len(ids))]
            if params.regex is not None or params.json_schema is not None:
                kind = "regex" if params.regex is not None else "json_schema"
                grammar = self._grammar(kind, params.regex or params.json_schema)
                kwargs["logits_processor"] = LogitsProcessorList([_GrammarMask(grammar, self._grammars, len(ids))])
            out = self.model.generate(torch.tensor([ids], device=self.device), **kwargs)[0, len(ids):].tolist()
        text = self.tokenizer.decode(out, skip_special_tokens=True)
        cut = [text.find(s) for s in stops if s in text]
        if cut:
            text = text[: min(cut)]
        meta = {"prompt_tokens": len(ids), "completion_tokens": len(out), "cached_tokens": 0}
        return rl.GenOutput(text, meta)

    def select(self, prompt: rl.Prompt, choices: list[str], temperature: float,
               choices_method: Any) -> rl.ChoicesDecision:
        prefix_ids = self._ids(prompt.text)
        input_lps, unconditional = [], []
        with self._lock, torch.inference_mode():
            for choice in choices:
                ids = self._ids(prompt.text + choice)
                shared = 0
                while shared < min(len(prefix_ids), len(ids) - 1) and ids[shared] == prefix_ids[shared]:
                    shared += 1
                input_lps.append(self._token_logprobs(ids, max(shared, 1)))
                if choices_method.requires_unconditional_logprobs:
                    alone = [e[1] for e in input_lps[-1]]
                    scored = self._token_logprobs(alone, 1) if len(alone) > 1 else []
                    unconditional.append([(None, alone[0], None), *scored])
        normalized = [sum(e[0] for e in lps) / len(lps) for lps in input_lps]
        decision = choices_method(choices=list(choices), normalized_prompt_logprobs=normalized,
                                  input_token_logprobs=input_lps, output_token_logprobs=[[] for _ in choices],
                                  unconditional_token_logprobs=unconditional or None)
        return apply_temperature(decision, list(choices), temperature)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _tokenizer_for_template(self) -> Any:
        return self.tokenizer
