"""Backend over a RadixLM server's native HTTP API (httpx).

Routes used (all with `Authorization: Bearer <api_key>` when an api_key is given):
  POST /generate               {"text" | "input_ids", "sampling_params", "return_logprob",
                                "logprob_start_len", "top_logprobs_num", "stream"} -> the Engine's
                                result dict (a list of them for a list of prompts); with
                                stream=true, server-sent events `data: {chunk}` ending with
                                `data: [DONE]`, each chunk carrying the new text since the last one
  POST /apply_chat_template    {"messages", "add_generation_prompt"} -> {"text"}  (the server must
                                provide it: role blocks are rendered by the model's template)
  POST /flush_cache, GET /server_info

Role blocks use the model's own chat template, measured through /apply_chat_template
(`get_chat_template()`, as SGLang's backend method). SGLang's own `sgl.RuntimeEndpoint` instead
guesses a template from the model path and falls back to its plain "default" one for RadixLM's
paths; give it `chat_template_name=` (SmolLM2: "chatml").

`select` needs to know where each choice's tokens begin. Pass `tokenizer=` (a HuggingFace
tokenizer object or a path/name for AutoTokenizer) matching the server's model for exact token
boundaries; without one a heuristic is used (see native.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from radixlm.lang.backend import BackendError
from radixlm.lang.native import NativeBackend


class RuntimeEndpoint(NativeBackend):
    def __init__(self, base_url: str, api_key: str | None = None, *, tokenizer: Any = None,
                 timeout: float | None = 600.0, transport: httpx.BaseTransport | None = None) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                    transport=transport)
        self._tokenizer_spec = tokenizer
        self._tokenizer: Any = None
        self._incremental: bool | None = None

    # --- HTTP helpers -------------------------------------------------------------------
    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.status_code >= 400:
            response.read()
            request = response.request
            status = response.status_code
            raise BackendError(f"{request.method} {request.url.path} -> {status}: {response.text}")

    def post(self, path: str, payload: dict) -> Any:
        """The JSON answer of POST `path`; BackendError for a status that is not a success."""
        response = self._client.post(path, json=payload)
        self._raise_for(response)
        return response.json()

    def _stream(self, payload: dict) -> Iterator[dict]:
        """The chunks of POST /generate as the server sends them (`streams_incrementally` says how)."""
        with self._client.stream("POST", "/generate", json=payload) as response:
            self._raise_for(response)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BackendError(f"POST /generate stream failed: {chunk['error']}")
                yield chunk

    def streams_incrementally(self) -> bool:
        if self._incremental is None:  # the server's option, read once (an SGLang server reports it too)
            self._incremental = bool(self.get_server_info().get("incremental_streaming_output", False))
        return self._incremental

    # --- NativeBackend transport ----------------------------------------------------------
    def _generate_raw(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                      logprob_start_len=-1, top_logprobs_num=0, stream=False, return_text_in_logprobs=False) -> Any:
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}}
        if input_ids is not None:
            payload["input_ids"] = input_ids
        else:
            payload["text"] = prompt
        if return_logprob:
            payload.update(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                           top_logprobs_num=top_logprobs_num)
            if return_text_in_logprobs:
                payload["return_text_in_logprobs"] = True
        if stream:
            payload["stream"] = True
            return self._stream(payload)
        return self.post("/generate", payload)

    def hf_tokenizer(self) -> Any:
        """The server's tokenizer, loaded once from the spec the endpoint was given (None without one)."""
        if self._tokenizer is None and self._tokenizer_spec is not None:
            if isinstance(self._tokenizer_spec, str):
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_spec)
            else:
                self._tokenizer = self._tokenizer_spec
        return self._tokenizer

    def tokenize(self, text: str) -> list[int] | None:
        tokenizer = self.hf_tokenizer()
        return None if tokenizer is None else list(tokenizer.encode(text))

    def decode_token(self, token_id: int) -> str | None:
        tokenizer = self.hf_tokenizer()
        return None if tokenizer is None else tokenizer.decode([token_id])

    def bos_token_id(self) -> int | None:
        tokenizer = self.hf_tokenizer()
        return None if tokenizer is None else getattr(tokenizer, "bos_token_id", None)

    def _tokenizer_for_template(self) -> Any:
        return self.hf_tokenizer()

    # --- chat template and administration -------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        payload = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return self.post("/apply_chat_template", payload)["text"]

    def flush_cache(self) -> bool:
        response = self._client.post("/flush_cache")
        return response.status_code == 200

    def get_server_info(self) -> dict:
        response = self._client.get("/server_info")
        self._raise_for(response)
        return response.json()

    def shutdown(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"
