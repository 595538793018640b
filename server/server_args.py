"""The HTTP server's options: the engine's (EngineArgs) and its own, one dataclass whose fields are
the flags of `python -m radixlm.server` and the keywords of `launch_server` (SGLang's ServerArgs)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from radixlm.runtime.engine_args import EngineArgs, check_seconds
from radixlm.runtime.launch_flags import check_parsers

API_KEY_ENV = "RADIXLM_API_KEY"


@dataclass(slots=True)
class ServerArgs(EngineArgs):
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # also from --api-key-file or $RADIXLM_API_KEY (not visible in `ps`)
    api_key_file: str | None = None  # a file holding the key (first line)
    allowed_hosts: str = ""  # without a key: Host names accepted besides IPs, localhost, the bind host ("*" = any)
    max_queued_requests: int = 256
    max_request_bytes: int = 4 * 1024 * 1024
    max_request_seconds: float = 600.0  # wall-clock cap per request, queueing included (0 = none)
    default_max_tokens: int | None = None  # chat without max_tokens: None = the rest of the context
    drain_timeout: float = 60.0  # SIGTERM: seconds in-flight requests may take before they get a final error
    served_model_name: str | None = None
    # CORS: comma-separated origins ("*" = any, never with credentials; "" = no CORS). A request whose Origin is
    # neither listed nor this server's own is refused (403) before its body is read: a web page cannot POST here
    allowed_origins: str = ""
    # /health is 503 once the scheduler loop has been silent this long: raise it where one step (a
    # prefill chunk of a large model on a CPU) can legitimately take longer
    health_stall_timeout: float = 5.0
    header_timeout: float = 10.0  # seconds a connection may take to send its request line and headers (0 = none)
    allow_control_tokens_in_content: bool = False  # chat: `<|im_start|>` typed in content is a control token (SGLang)
    tool_call_parser: str | None = None  # auto (None) | hermes | qwen | qwen25 | qwen3 | llama3 | mistral
    reasoning_parser: str | None = None  # qwen3 | qwen3-thinking | deepseek-r1 (request/reasoning.py)
    enable_metrics: bool = False  # accepted; /metrics is always served

    def __post_init__(self) -> None:
        EngineArgs.__post_init__(self)
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        check_seconds(self, "max_request_seconds", "drain_timeout", "header_timeout", "health_stall_timeout")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        check_parsers(self.tool_call_parser, self.reasoning_parser)

    def engine_args(self) -> EngineArgs:
        """The engine's share, for the scheduler process."""
        return EngineArgs(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineArgs)})

    def with_api_key_resolved(self) -> ServerArgs:
        """The key from api_key, else the first line of api_key_file, else $RADIXLM_API_KEY (the
        last two keep it out of `ps`); ValueError for a file that is missing or empty."""
        if self.api_key and self.api_key_file:
            raise ValueError("give --api-key or --api-key-file, not both")
        key = self.api_key
        if self.api_key_file:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    lines = f.read().strip().splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read --api-key-file: {e}") from e
            key = lines[0].strip() if lines else ""
            if not key:
                raise ValueError(f"--api-key-file {self.api_key_file} is empty")
        return dataclasses.replace(self, api_key=key or os.environ.get(API_KEY_ENV) or None, api_key_file=None)
