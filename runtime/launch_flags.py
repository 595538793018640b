"""SGLang's and vLLM's launch flags that mean what one of ours means, so their users' commands work.

`EngineArgs.add_cli_args` adds each alias as another spelling of our flag (`--model-path` sets
`model`). Flags of theirs that name a feature we lack with a value we cannot honour are refused
with a message saying what to do instead (`--tp-size 2`); flags that ask for what we always do are
accepted and change nothing (`--enable-metrics`, `--trust-remote-code`: we never run code from a
checkpoint, every architecture is built in). This module imports nothing heavy: the CLI's `--help`
must stay fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# our field -> the other spellings (SGLang's first, then vLLM's)
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("--model-path",),
    "context_length": ("--max-model-len",),
    "max_running_requests": ("--max-num-seqs",),
    "chunked_prefill_size": ("--max-num-batched-tokens",),
    "random_seed": ("--seed",),
    "tp_size": ("--tp", "--tensor-parallel-size"),
    "dp_size": ("--dp", "--data-parallel-size"),
    "mem_fraction_static": ("--gpu-memory-utilization",),
}

# the same spellings as keywords (`Engine(model_path=...)`, vLLM's `LLM(max_model_len=...)`) -> our field
KEYWORD_ALIASES: dict[str, str] = {flag[2:].replace("-", "_"): field
                                   for field, flags in ALIASES.items() for flag in flags}

# accepted, no effect: what they switch on is always on here
NO_OPS = ("--enable-prefix-caching", "--enable-auto-tool-choice", "--disable-log-requests",
          "--disable-log-stats", "--skip-server-warmup")

# the HTTP server's own options (server/server_args.py): Engine(**kwargs) accepts and ignores them,
# as SGLang's Engine, which takes every field of its ServerArgs, does
SERVER_ONLY = frozenset({
    "host", "port", "api_key", "api_key_file", "allowed_hosts", "max_queued_requests", "max_request_bytes",
    "max_request_seconds", "default_max_tokens", "drain_timeout", "served_model_name", "allowed_origins",
    "health_stall_timeout", "header_timeout", "allow_control_tokens_in_content", "tool_call_parser",
    "reasoning_parser", "enable_metrics"})

# --tool-call-parser: the formats of server/tool_calls.py (auto: read off the chat template)
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen", "qwen25", "qwen3", "llama3", "mistral")
# --reasoning-parser: the thinking-block formats of request/reasoning.py (server/reasoning.py splits them off)
REASONING_PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1")


def add_extra_flags(parser: argparse.ArgumentParser) -> None:
    """The spellings that are not another name of one field."""
    for flag in NO_OPS:
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    # vLLM's way to turn the prefix cache off
    parser.add_argument("--no-enable-prefix-caching", dest="disable_radix_cache", action="store_true",
                        help=argparse.SUPPRESS)


def check(tp_size: int, dp_size: int, mem_fraction_static: float | None) -> None:
    """ValueError naming what to do instead, for values we cannot honour."""
    if tp_size != 1:
        raise ValueError(f"tp_size {tp_size}: RadixLM runs a model on one device (tensor parallelism needs the "
                         "tensor-parallel feature, not built yet); leave --tp-size at 1")
    if dp_size != 1:
        raise ValueError(f"dp_size {dp_size}: for several replicas of the model use --replicas N (Ray Serve)")
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")


def check_parsers(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError for a parser name RadixLM does not have."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {tool_call_parser!r}; RadixLM has {', '.join(TOOL_CALL_PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        have = ", ".join(REASONING_PARSERS) or "none"
        raise ValueError(f"unknown reasoning_parser {reasoning_parser!r}; RadixLM has {have}")


def read_chat_template(value: str) -> str:
    """`--chat-template`: a Jinja file, or the template itself (it holds `{%` or `{{`). Read once at
    start-up from the operator's command line; no request ever names a file."""
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {value!r} is neither a Jinja file nor a template (RadixLM has no named "
                         "templates: the model's own template is the default)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read chat_template {value!r}: {e}") from e
