"""The detokenizer process: token ids -> text, incrementally per request, with stop strings trimmed.

It keeps one IncrementalDetokenizer (runtime/output/detokenizer.py, the Engine's too) per live request,
so streamed text never shows what the final answer drops. Control replies pass through unchanged,
keeping their order relative to the outputs.
"""

from __future__ import annotations

import json
import logging
import signal
import traceback
from pathlib import Path

import zmq

from radixlm.runtime.output.detokenizer import IncrementalDetokenizer
from radixlm.runtime.output.plain_decoder import PlainDecoder
from radixlm.server import messages as m
from radixlm.server.logging_setup import setup_logging
from radixlm.server.parent_watch import watch_parent

logger = logging.getLogger("radixlm.server.detokenizer")

IDLE_POLL_MS = 500


def run_detokenizer_process(model_path: str, log_level: str, addrs: dict[str, str], decoder: str | None,
                            ready_conn) -> None:
    """`decoder`: the tokenizer's decoder (runtime/output/plain_decoder.py), or None: transformers' own
    tokenizer of `model_path` decodes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the HTTP process stops us
    setup_logging(log_level, "detokenizer")
    try:
        if decoder is not None:
            tokenizer = PlainDecoder(decoder)
        else:
            from radixlm.runtime.executor.loader import load_tokenizer

            tokenizer = load_tokenizer(Path(model_path))
        worker = Detokenizer(tokenizer)
        ctx = zmq.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(addrs["detokenizer"])
        outbox = ctx.socket(zmq.PUSH)
        outbox.connect(addrs["tokenizer"])
    except BaseException as e:
        logger.error("detokenizer failed to start: %s", e)
        ready_conn.send_bytes(json.dumps({"ok": False, "error": f"{e}\n{traceback.format_exc()}"}).encode())
        raise SystemExit(1) from e
    ready_conn.send_bytes(json.dumps({"ok": True}).encode())
    ready_conn.close()
    parent_gone = watch_parent(addrs, "detokenizer")
    linger_ms = 1000
    try:
        while not parent_gone.is_set():
            if not inbox.poll(IDLE_POLL_MS):
                continue
            data = inbox.recv()
            try:
                msg = m.decode(data)
            except Exception as e:
                logger.error("dropping a malformed message (%d bytes): %s", len(data), e)
                continue
            if isinstance(msg, m.TokenBatch):
                outbox.send(m.encode(worker.process(msg)))
            elif isinstance(msg, m.ControlReply):
                outbox.send(data)
            elif isinstance(msg, m.ShutdownReq):
                # the HTTP process is stopping (or restarting this pair) and reads nothing more: what
                # is still queued for it is dropped rather than waited on
                linger_ms = 0
                return
            else:
                logger.error("unexpected message for the detokenizer: %s", type(msg).__name__)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=linger_ms)
        ctx.term()


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, IncrementalDetokenizer] = {}

    def process(self, batch: m.TokenBatch) -> m.TextBatch:
        for p in batch.new_requests:
            self.states[p.rid] = IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens,
                                                        p.no_stop_trim, p.strip_prefix, p.incremental)
        outs = []
        for step in batch.outputs:
            detok = self.states.get(step.rid)
            if detok is None:  # cannot happen: params come with or before the first output
                logger.error("output for unknown request %s; decoding with defaults", step.rid)
                detok = self.states[step.rid] = IncrementalDetokenizer(self.tokenizer, [])
            text = detok.add(step.new_ids, step.finish)
            if step.finish is not None:
                del self.states[step.rid]
            outs.append(m.TextOut(
                rid=step.rid, text=text, new_ids=step.new_ids, finish=step.finish,
                prompt_tokens=step.prompt_tokens, completion_tokens=step.completion_tokens,
                cached_tokens=step.cached_tokens, input_logprobs=step.input_logprobs,
                input_top_logprobs=step.input_top_logprobs, output_logprobs=step.output_logprobs,
                output_top_logprobs=step.output_top_logprobs, jump_forward_tokens=step.jump_forward_tokens,
                queue_time=step.queue_time, input_token_ids_logprobs=step.input_token_ids_logprobs,
                output_token_ids_logprobs=step.output_token_ids_logprobs,
            ))
        return m.TextBatch(outputs=outs, stats=batch.stats)
