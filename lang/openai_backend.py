"""Backend over any OpenAI-compatible /v1 server, through the `openai` package.

Chat models (the default) generate whole assistant messages, so a gen must come right at the
start of an assistant role: `s += assistant(gen("answer"))`; the state's completed messages
are sent as the chat history. Completion models (`is_chat_model=False`) get the state text.

Mapping of gen settings:
  max_tokens, temperature, top_p, stop, frequency/presence penalties -> the standard fields
  json_schema -> response_format {"type": "json_schema", ...}
  regex       -> not part of the OpenAI API: a NotImplementedError, unless `supports_regex=True`
                 (servers such as RadixLM, SGLang and vLLM accept an extra "regex" field)
  top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, min_tokens, stop_regex,
  token_healing -> extra body fields (non-OpenAI servers accept them; api.openai.com rejects them
                 with its own error)
  return_logprob -> NotImplementedError (token ids are not exposed by the API)
select on a chat model uses a JSON-schema constrained answer with an enum of the choices (no
scores in its meta info); select on a completion model is not supported.
Role blocks are shown in `s.text()` with a plain ChatML rendering (the server applies the real
template to the messages).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from radixlm.lang.backend import Backend, BackendError, GenOutput, Prompt
from radixlm.lang.chat_template import chatml_render
from radixlm.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from radixlm.lang.ir import GenParams

_EXTRA_DEFAULTS = {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": False}


@dataclass
class TokenUsage:
    """Tokens billed so far by this backend's calls (SGLang's `OpenAI(...).token_usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def reset(self) -> None:
        self.prompt_tokens = self.completion_tokens = 0

    def add(self, usage: Any) -> None:
        if usage is not None:
            with _USAGE_LOCK:
                self.prompt_tokens += getattr(usage, "prompt_tokens", 0) or 0
                self.completion_tokens += getattr(usage, "completion_tokens", 0) or 0


_USAGE_LOCK = threading.Lock()


class OpenAI(Backend):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None, *,
                 is_chat_model: bool = True, supports_regex: bool = False, client: Any = None,
                 **client_kwargs: Any) -> None:
        super().__init__()
        self.model_name = model_name
        self.is_chat_model = is_chat_model
        self.supports_regex = supports_regex
        if client is None:
            import openai

            key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
            client = openai.OpenAI(base_url=base_url, api_key=key, **client_kwargs)
        self.client = client
        self.token_usage = TokenUsage()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return chatml_render(messages, add_generation_prompt)

    def role_stops(self, role: str) -> tuple[list[str], list[int]]:
        return [], []  # the API ends messages by itself

    # --- request building -----------------------------------------------------------------
    def _request(self, params: GenParams) -> dict[str, Any]:
        params = params.resolve_dtype()
        if params.return_logprob:
            raise NotImplementedError("return_logprob is not supported by the OpenAI backend")
        kwargs: dict[str, Any] = {}
        for ours, theirs in (("max_new_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("stop", "stop"), ("frequency_penalty", "frequency_penalty"),
                             ("presence_penalty", "presence_penalty")):
            value = getattr(params, ours)
            if value is not None and value != []:
                kwargs[theirs] = value
        extra: dict[str, Any] = {}
        for name, default in _EXTRA_DEFAULTS.items():
            value = getattr(params, name)
            if value is not None and value != default:
                extra[name] = value
        if params.stop_token_ids:
            extra["stop_token_ids"] = params.stop_token_ids
        # non-OpenAI fields, by the names vLLM / SGLang / RadixLM servers read
        if params.min_new_tokens:
            extra["min_tokens"] = params.min_new_tokens
        if params.stop_regex:
            extra["stop_regex"] = params.stop_regex
        if params.token_healing:
            extra["token_healing"] = True
        if params.regex is not None:
            if not self.supports_regex:
                raise NotImplementedError(
                    "regex constraints (also gen(dtype=...)) are not part of the OpenAI API; use a native "
                    "backend (Engine, RuntimeEndpoint) or OpenAI(..., supports_regex=True) for a server "
                    "that accepts an extra 'regex' field"
                )
            extra["regex"] = params.regex
        if params.json_schema is not None:
            kwargs["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(params.json_schema)},
            }
        if extra:
            kwargs["extra_body"] = extra
        return kwargs

    def _chat_messages(self, prompt: Prompt) -> list[dict]:
        if prompt.role != "assistant" or prompt.role_text:
            raise BackendError(
                "OpenAI chat models generate whole assistant messages: put gen()/select() right at the "
                "start of an assistant role, e.g. s += assistant(gen('answer')), or turn on API speculative "
                "execution, e.g. @function(num_api_spec_tokens=128), to run text and gens inside one turn"
            )
        return [dict(m) for m in prompt.messages]

    @staticmethod
    def _meta(response: Any, finish: str | None) -> dict[str, Any]:
        usage = getattr(response, "usage", None)
        return {
            "id": getattr(response, "id", None),
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "finish_reason": {"type": finish} if finish else None,
        }

    # --- Backend interface ----------------------------------------------------------------
    def generate(self, prompt: Prompt, params: GenParams) -> GenOutput:
        kwargs = self._request(params)
        if self.is_chat_model:
            response = self.client.chat.completions.create(
                model=self.model_name, messages=self._chat_messages(prompt), **kwargs
            )
            self.token_usage.add(getattr(response, "usage", None))
            choice = response.choices[0]
            return GenOutput(choice.message.content or "", self._meta(response, choice.finish_reason))
        response = self.client.completions.create(model=self.model_name, prompt=prompt.text, **kwargs)
        self.token_usage.add(getattr(response, "usage", None))
        choice = response.choices[0]
        return GenOutput(choice.text, self._meta(response, choice.finish_reason))

    def generate_stream(self, prompt: Prompt, params: GenParams) -> Iterator[tuple[str, dict]]:
        kwargs = self._request(params)
        kwargs["stream_options"] = {"include_usage": True}
        if self.is_chat_model:
            stream = self.client.chat.completions.create(
                model=self.model_name, messages=self._chat_messages(prompt), stream=True, **kwargs
            )
        else:
            stream = self.client.completions.create(model=self.model_name, prompt=prompt.text, stream=True,
                                                    **kwargs)
        for chunk in stream:
            self.token_usage.add(getattr(chunk, "usage", None))  # the last chunk carries the usage
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            piece = (choice.delta.content if self.is_chat_model else choice.text) or ""
            yield piece, self._meta(chunk, choice.finish_reason)

    def select(self, prompt: Prompt, choices: list[str], temperature: float,
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        if not self.is_chat_model:
            raise NotImplementedError("select is not supported for OpenAI completion models")
        schema = {
            "type": "object",
            "properties": {"choice": {"type": "string", "enum": list(choices)}},
            "required": ["choice"],
            "additionalProperties": False,
        }
        response = self.client.chat.completions.create(
            model=self.model_name,
            messages=self._chat_messages(prompt),
            temperature=temperature,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "choice", "schema": schema, "strict": True}},
        )
        self.token_usage.add(getattr(response, "usage", None))
        content = response.choices[0].message.content or ""
        try:
            decision = json.loads(content)["choice"]
        except (ValueError, KeyError, TypeError) as e:
            raise BackendError(f"select: the answer does not follow the choice schema: {content!r}") from e
        if decision not in choices:
            raise BackendError(f"select: the server chose {decision!r}, which is not one of {choices!r}")
        return ChoicesDecision(decision, {"method": "json_schema_enum", **self._meta(response, None)})

    def __repr__(self) -> str:
        return f"OpenAI({self.model_name!r})"
