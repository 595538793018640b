"""The scheduler process: the Engine's SchedulerDriver (runtime/driver.py) over a zmq transport.

The transport turns wire messages into the driver's commands (GenerateReq -> Submit, AbortReq ->
Abort, ControlReq -> Call, ShutdownReq -> Stop) and the driver's outputs into TokenBatches for the
detokenizer. A message it cannot read is answered (if it names a request) and never crashes it.
"""

from __future__ import annotations

import gc
import json
import logging
import signal
import threading
import time
import traceback

import msgspec
import zmq

from radixlm.runtime.driver import Abort, Call, SchedulerDriver, Stop, Submit
from radixlm.runtime.engine_args import EngineArgs
from radixlm.runtime.executor.model_runner import ModelRunner
from radixlm.runtime.request.healing import healed_text
from radixlm.runtime.request.req import FinishReason, Req, SchedulerStats, StepOutput
from radixlm.runtime.scheduler.scheduler import Scheduler
from radixlm.server import messages as m
from radixlm.server.logging_setup import setup_logging
from radixlm.server.parent_watch import watch_parent

logger = logging.getLogger("radixlm.server.scheduler")


def run_scheduler_process(args_dict: dict, addrs: dict[str, str], ready_conn) -> None:
    """Process entry point. Reports readiness (or the load error) as JSON on `ready_conn`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the HTTP process stops us
    args = EngineArgs(**args_dict)
    setup_logging(args.log_level, "scheduler")
    try:
        runner = ModelRunner(args)
        scheduler = Scheduler(args, runner)
        transport = ZmqTransport(addrs, runner.tokenizer, watch_parent(addrs, "scheduler"))
        if runner.device.type == "cpu":  # a GPU's prefill step is short: a straggler joins the next one
            transport.gather_max_s = CPU_GATHER_MAX_S
        driver = SchedulerDriver(scheduler, args, transport)
    except BaseException as e:
        logger.error("scheduler failed to start: %s", e)
        ready_conn.send_bytes(json.dumps({"ok": False, "error": f"{e}\n{traceback.format_exc()}"}).encode())
        raise SystemExit(1) from e
    ready_conn.send_bytes(json.dumps({
        "ok": True,
        "model_path": runner.model_path,
        "vocab_size": runner.vocab_size,
        "context_len": runner.context_len,
        "pool_size": runner.allocator.num_slots,
    }).encode())
    ready_conn.close()
    gc.freeze()  # the model, tokenizer and modules stay: a full collection walks only what requests made
    # The loop runs on a worker thread, as in the Engine; the model's steps run on the runner's
    # compute thread either way (executor/compute_thread.py).
    crashed = []

    def run() -> None:
        try:
            driver.run()
        except BaseException:
            logger.exception("the scheduler loop crashed")
            crashed.append(True)

    worker = threading.Thread(target=run, name="radixlm-scheduler-loop")
    worker.start()
    worker.join()
    transport.close()
    if crashed:
        raise SystemExit(1)


# On the CPU, an idle scheduler that receives a request waits up to this long for the requests the
# HTTP process says are on their way (driver.SchedulerDriver._arrivals): a prefill step there takes a
# second or more, which a request sent with the first would otherwise wait out.
CPU_GATHER_MAX_S = 0.05


class ZmqTransport:
    gather_max_s = 0.0  # see CPU_GATHER_MAX_S

    def __init__(self, addrs: dict[str, str], tokenizer=None, parent_gone: threading.Event | None = None):
        self.tokenizer = tokenizer  # token healing: which output text the prompt already has
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(addrs["scheduler"])
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.connect(addrs["detokenizer"])
        self.new_requests: list[m.DetokParams] = []
        self.expecting = 0  # requests the HTTP process was still preparing, as of its latest GenerateReq
        self.parent_gone = parent_gone or threading.Event()
        self._last_sent = time.monotonic()
        self._convert = {
            m.GenerateReq: self._generate,
            m.AbortReq: lambda msg: Abort(msg.rid),
            m.ControlReq: lambda msg: Call(msg.name, lambda ok, value: self._reply(msg.call_id, ok, value),
                                           dict(msg.args)),
            m.ShutdownReq: self._shutdown,
        }

    def receive(self, timeout: float) -> list:
        """Called once per loop iteration, so it also sends the heartbeat (messages.HEARTBEAT_S): one
        never comes from a step that hangs, so the HTTP process's /health notices."""
        if time.monotonic() - self._last_sent >= m.HEARTBEAT_S:
            self._send(m.TokenBatch(outputs=[]))
        cmds: list = []
        if not self.inbox.poll(int(timeout * 1000)):
            return cmds
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return cmds
            try:
                msg = m.decode(data)
            except Exception as e:  # never crash on a malformed message; answer it if it names a request
                logger.error("malformed message (%d bytes): %s", len(data), e)
                self._refuse(_rid_of(data), f"malformed request: {e}")
                continue
            convert = self._convert.get(type(msg))
            if convert is None:
                logger.error("unexpected message for the scheduler: %s", type(msg).__name__)
                continue
            cmds.append(convert(msg))
            if isinstance(cmds[-1], Stop):
                return cmds

    def deliver(self, outputs: list[StepOutput], stats: SchedulerStats | None) -> None:
        # detokenization parameters travel ahead of (or with) the request's first output
        batch = m.TokenBatch(outputs=outputs, new_requests=self.new_requests, stats=stats)
        self.new_requests = []
        self._send(batch)

    def peer_alive(self) -> bool:
        return not self.parent_gone.is_set()

    def close(self) -> None:
        self.outbox.send(m.encode(m.ShutdownReq("scheduler stopped")))  # the detokenizer exits on it
        self.inbox.close(linger=0)
        self.outbox.close(linger=1000)
        self.ctx.term()

    def _generate(self, msg: m.GenerateReq) -> Submit:
        self.expecting = msg.pending
        p = msg.params
        strip = "" if self.tokenizer is None else healed_text(msg.input_ids, p, self.tokenizer)
        self.new_requests.append(m.DetokParams(msg.rid, list(p.stop), p.skip_special_tokens, p.no_stop_trim, strip,
                                               incremental=msg.stream))
        return Submit(Req(rid=msg.rid, input_ids=msg.input_ids, params=p, return_logprob=msg.return_logprob,
                          logprob_start_len=msg.logprob_start_len, top_logprobs_num=msg.top_logprobs_num,
                          stream=msg.stream, after_thinking=msg.after_thinking,
                          token_ids_logprob=msg.token_ids_logprob))

    @staticmethod
    def _shutdown(msg: m.ShutdownReq) -> Stop:
        return Stop(msg.reason)

    def _reply(self, call_id: int, ok: bool, value) -> None:
        self._send(m.ControlReply(call_id, ok=ok, value=value if ok else None, error=None if ok else str(value)))

    def _send(self, msg: m.Message) -> None:
        self.outbox.send(m.encode(msg))
        self._last_sent = time.monotonic()

    def _refuse(self, rid: str | None, message: str) -> None:
        """Finishes a request that never reached the scheduler with an abort, so no one waits for it."""
        if rid is not None:
            self.new_requests.append(m.DetokParams(rid))
            self.deliver([StepOutput(rid, [], FinishReason("abort", message=message, code=400), 0, 0, 0)], None)


def _rid_of(data: bytes) -> str | None:
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:
        return None
    rid = raw.get("rid") if isinstance(raw, dict) and raw.get("type") == "GenerateReq" else None
    return rid if isinstance(rid, str) else None
