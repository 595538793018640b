"""Every message that crosses a process boundary, and the one codec that carries them.

Grouped by receiver (sockets are PUSH -> PULL, each receiver binds one `ipc://` address):

    TokenizerManager --> Scheduler     GenerateReq, AbortReq, ControlReq, ShutdownReq
    Scheduler        --> Detokenizer   TokenBatch (token ids), ControlReply, ShutdownReq (forwarded)
    Detokenizer      --> TokenizerMgr  TextBatch (text deltas), ControlReply (forwarded)

The scheduler loop sends a batch (an empty one if it has nothing else to say) at least every
HEARTBEAT_S while it goes round: its arrival is how the HTTP process knows the loop is not stuck.

Encoded with msgspec msgpack into tagged unions: nothing is ever unpickled from a socket. The
runtime's own dataclasses (SamplingParams, StepOutput, FinishReason) travel as they are; msgspec
re-validates them (and runs their ``__post_init__``) on decode. Integers are bounded to 64 bits by
the validation before anything is encoded.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from radixlm.runtime.request.params import SamplingParams
from radixlm.runtime.request.req import FinishReason, SchedulerStats, StepOutput

HEARTBEAT_S = 1.0


# ----------------------------------------------------------------------- to the scheduler
class GenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    after_thinking: tuple[int, int, bool] | None = None  # Req.after_thinking
    token_ids_logprob: list[int] | None = None  # Req.token_ids_logprob
    pending: int = 0  # generation requests the HTTP process was still preparing as it sent this (Arrivals)


class AbortReq(msgspec.Struct, tag=True):
    rid: str | None  # None: every request in flight


class ControlReq(msgspec.Struct, tag=True):
    """A control call (a key of SchedulerDriver.calls: "flush_cache", "server_info", "cache_summary", ...)
    with its keyword arguments. Integers only: no request can name a file (a snapshot's path is the
    operator's --cache-snapshot, read by the scheduler itself)."""

    call_id: int
    name: str
    args: dict[str, int] = {}


class ShutdownReq(msgspec.Struct, tag=True):
    """Finish every request (abort) and exit; the detokenizer exits when this reaches it."""

    reason: str = "server shutting down"


# ----------------------------------------------------------------------- to the detokenizer
class DetokParams(msgspec.Struct):
    """How to turn one request's ids into text; sent with the request's first output."""

    rid: str
    stop: list[str] = []
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    strip_prefix: str = ""  # token healing: output text the prompt already has (left out)
    incremental: bool = True  # False: not streamed, so only the finished text is read (decoded once)


class TokenBatch(msgspec.Struct, tag=True):
    outputs: list[StepOutput]
    new_requests: list[DetokParams] = []
    stats: SchedulerStats | None = None


class ControlReply(msgspec.Struct, tag=True):
    call_id: int
    ok: bool
    value: Any = None
    error: str | None = None


# ----------------------------------------------------------------------- to the tokenizer manager
class TextOut(msgspec.Struct):
    """One request's progress: the ids and the text that became final since the last one."""

    rid: str
    text: str
    new_ids: list[int]
    finish: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    jump_forward_tokens: int = 0
    queue_time: float | None = None
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_ids_logprobs: list[list[tuple[float, int]]] | None = None


class TextBatch(msgspec.Struct, tag=True):
    outputs: list[TextOut]
    stats: SchedulerStats | None = None


Message = Union[  # noqa: UP007 (msgspec needs a real Union of tagged structs)
    GenerateReq, AbortReq, ControlReq, ShutdownReq, TokenBatch, ControlReply, TextBatch
]
MESSAGE_TYPES: tuple[type, ...] = Message.__args__

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.ValidationError / DecodeError for bytes that are not one of our messages."""
    return _decoder.decode(data)


__all__ = [
    "HEARTBEAT_S", "MESSAGE_TYPES", "AbortReq", "ControlReply", "ControlReq", "DetokParams", "GenerateReq", "Message",
    "SamplingParams", "SchedulerStats", "ShutdownReq", "StepOutput", "TextBatch", "TextOut",
    "TokenBatch", "decode", "encode",
]
