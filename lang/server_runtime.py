"""`Runtime`: a RadixLM server launched from Python for the language (SGLang's Runtime).

    runtime = rl.Runtime(model_path="smollm2-135m")
    rl.set_default_backend(runtime)            # programs talk to it over HTTP (its `endpoint`)
    ...
    runtime.shutdown()                         # also at interpreter exit

The server runs in a child process (`radixlm.server.launch_server`) on a free loopback port.
Arguments are SGLang's server arguments: `model_path` (or `model`), `port` (the first free port
from there; default 30000), and every RadixLM server option by name. SGLang options RadixLM has
no use for (tp_size=1, mem_fraction_static, trust_remote_code, ...) are accepted and ignored with
a debug log; any other name is a TypeError naming it.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

from radixlm.lang.runtime_endpoint import RuntimeEndpoint

logger = logging.getLogger(__name__)

# SGLang ServerArgs fields that have no effect here (single device, no quantization switches...).
_IGNORED_SGLANG_ARGS = frozenset({
    "tokenizer_path", "tokenizer_mode", "trust_remote_code", "mem_fraction_static", "dp_size",
    "enable_torch_compile", "skip_tokenizer_init", "revision",
    "chat_template", "quantization", "load_format", "watchdog_timeout", "enable_mixed_chunk",
    "disable_overlap_schedule", "stream_interval", "show_time_cost", "enable_metrics", "launch_timeout",
    "base_gpu_id", "kv_cache_dtype", "is_embedding", "enable_p2p_check", "log_requests",
})


def _free_port(start: int) -> int:
    for port in range(start, 65536):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port from {start}")


class Runtime:
    def __init__(self, log_level: str = "error", *args: Any, **kwargs: Any) -> None:
        from radixlm.runtime import launch_flags
        from radixlm.server import launch_server
        from radixlm.server.server_args import ServerArgs

        if args:
            raise TypeError("Runtime takes keyword arguments only (model_path=..., port=...)")
        tp = kwargs.pop("tp_size", 1)
        if tp not in (1, None):
            raise ValueError(f"tp_size={tp}: RadixLM runs a model on one device")
        known = {f.name for f in dataclasses.fields(ServerArgs)} | set(launch_flags.KEYWORD_ALIASES)
        for name in sorted(set(kwargs) & _IGNORED_SGLANG_ARGS - known):
            logger.debug("Runtime: ignoring SGLang option %s=%r", name, kwargs.pop(name))
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"Runtime: unknown option(s) {', '.join(unknown)}")
        kwargs["port"] = _free_port(int(kwargs.get("port") or 30000))
        self._handle = launch_server(log_level=log_level, **kwargs)
        self.url = self._handle.url
        self.generate_url = self.url + "/generate"
        self.server_args = kwargs
        self.endpoint = RuntimeEndpoint(self.url, api_key=kwargs.get("api_key"), tokenizer=self._tokenizer_path())
        atexit.register(self.shutdown)

    def _tokenizer_path(self) -> str | None:
        try:
            from radixlm.runtime.executor.loader import resolve_model

            return str(resolve_model(self.server_args.get("model", "smollm2-135m")).folder)
        except Exception:  # the endpoint then scores select() without a tokenizer
            return None

    def shutdown(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            self.endpoint.shutdown()
            handle.shutdown()

    def cache_prefix(self, prefix: str) -> None:
        from radixlm.lang.backend import Prompt

        self.endpoint.cache_prefix(Prompt(prefix))

    def get_tokenizer(self) -> Any:
        return self.endpoint.hf_tokenizer()

    def get_server_info(self) -> dict:
        return self.endpoint.get_server_info()

    def generate(self, prompt: str | list[str], sampling_params: dict | None = None,
                 return_logprob: bool | list[bool] = False, logprob_start_len: int | list[int] | None = None,
                 top_logprobs_num: int | list[int] | None = None, lora_path: Any = None) -> str:
        """POST /generate; returns the response as a JSON string (SGLang's Runtime does)."""
        if lora_path is not None:
            raise ValueError("lora_path: LoRA adapters are not supported")
        payload: dict[str, Any] = {"text": prompt, "sampling_params": sampling_params or {}}
        if return_logprob:
            payload.update(return_logprob=return_logprob, logprob_start_len=-1 if logprob_start_len is None
                           else logprob_start_len, top_logprobs_num=top_logprobs_num or 0)
        return json.dumps(self.endpoint.post("/generate", payload))

    async def async_generate(self, prompt: str, sampling_params: dict | None = None) -> AsyncIterator[str]:
        """Stream the generated text piece by piece (SGLang's Runtime.async_generate)."""
        import httpx

        payload = {"text": prompt, "sampling_params": sampling_params or {}, "stream": True}
        incremental = await asyncio.to_thread(self.endpoint.streams_incrementally)
        sent = 0
        async with httpx.AsyncClient(timeout=None) as client:
            async with client.stream("POST", self.generate_url, json=payload) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise RuntimeError(f"POST /generate -> {response.status_code}: {response.text}")
                async for line in response.aiter_lines():
                    data = line[len("data:"):].strip() if line.startswith("data:") else ""
                    if not data or data == "[DONE]":
                        continue
                    text = json.loads(data).get("text", "")
                    if incremental:
                        if text:
                            yield text
                    elif len(text) > sent:
                        yield text[sent:]
                        sent = len(text)

    add_request = async_generate

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing left to report to
            pass
