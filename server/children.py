"""The HTTP process's two children: starting the scheduler and the detokenizer, waiting for them to be
ready, and stopping them (server/launch.py restarts them through here when one dies).

Children are `spawn`ed with plain dicts as arguments and named by `CHILD_MAINS` to
server/child_main.py; each reports readiness (or its load error) as JSON over a pipe.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Callable
from typing import Any

from radixlm.server.server_args import ServerArgs

STARTUP_TIMEOUT_S = 900


class ServerStartError(RuntimeError):
    pass


def spawn_context():
    return multiprocessing.get_context("spawn")


def wait_ready(conn, proc, what: str, timeout: float) -> dict:
    """The JSON readiness message of a child; ServerStartError if it fails, dies or times out."""
    deadline = time.monotonic() + timeout
    while True:
        ready = multiprocessing.connection.wait([conn, proc.sentinel], timeout=max(deadline - time.monotonic(), 0))
        if conn in ready:
            try:
                info = json.loads(conn.recv_bytes())
            except EOFError:
                info = {"ok": False, "error": "it exited during startup"}
            if not info.get("ok"):
                raise ServerStartError(f"the {what} failed to start: {info.get('error', '').strip()}")
            return info
        if proc.sentinel in ready:
            proc.join(1)
            raise ServerStartError(f"the {what} exited during startup (exit code {proc.exitcode}); see its log")
        if time.monotonic() >= deadline:
            raise ServerStartError(f"the {what} did not start within {timeout:.0f}s")


# each child's main function as "module:function" (server/child_main.py); tests swap in wrappers
CHILD_MAINS = {
    "scheduler": "radixlm.server.scheduler_process:run_scheduler_process",
    "detokenizer": "radixlm.server.detokenizer_process:run_detokenizer_process",
}


def start_children(args: ServerArgs, addrs: dict[str, str], tokenizer: Any = None,
                   meanwhile: Callable[[], None] | None = None) -> tuple[dict[str, Any], list, Any]:
    """Starts the scheduler, then the detokenizer; returns the scheduler's info, the processes and the
    tokenizer (loaded here unless a restart passes the one it has) once both children are ready.

    The scheduler is started before this process imports torch: its imports and model load are most
    of a start, and they run on another core while this process resolves the model (a GGUF is
    converted once, under a lock both processes take), reads the tokenizer, starts the detokenizer
    with the tokenizer's decoder (runtime/output/plain_decoder.py: it then never imports
    transformers) and runs `meanwhile`."""
    from radixlm.server.child_main import run

    ctx = spawn_context()
    procs, waits = [], []

    def start(what: str, name: str, main: str, child_args: tuple) -> None:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run, args=(main, *child_args, send), name=name, daemon=True)
        proc.start()
        send.close()
        procs.append(proc)
        waits.append((recv, proc, what))

    try:
        start("scheduler process", "radixlm-scheduler", CHILD_MAINS["scheduler"],
              (dataclasses.asdict(args.engine_args()), addrs))
        from radixlm.runtime.executor.loader import ConversionPending, load_tokenizer, resolve_model

        info = None
        try:
            folder = str(resolve_model(args.model, convert=False).folder)
        except ConversionPending:  # a first start: the scheduler converts the GGUF (this process has no torch)
            info = wait_ready(*waits[0], STARTUP_TIMEOUT_S)
            folder = info["model_path"]
        if tokenizer is None:
            tokenizer = load_tokenizer(folder, args.chat_template)
        from radixlm.runtime.output.plain_decoder import decoder_spec

        start("detokenizer process", "radixlm-detokenizer", CHILD_MAINS["detokenizer"],
              (folder, args.log_level, addrs, decoder_spec(tokenizer)))
        if meanwhile is not None:
            meanwhile()
        ready = [wait_ready(recv, proc, what, STARTUP_TIMEOUT_S) for recv, proc, what in waits[1 if info else 0:]]
        info = info or ready[0]
    except BaseException as e:
        stop_children(procs, None)
        if isinstance(e, Exception) and not isinstance(e, ServerStartError):
            raise ServerStartError(f"cannot start the server: {e}") from e
        raise
    return info, procs, tokenizer


def stop_children(procs: list, addrs: dict[str, str] | None, timeout: float = 10.0) -> None:
    """Asks the scheduler to stop (it tells the detokenizer), then terminates what is left."""
    if addrs is not None and any(p.is_alive() for p in procs):
        import zmq

        from radixlm.server import messages as m

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(addrs["scheduler"])
        sock.send(m.encode(m.ShutdownReq("server shutting down")))
        sock.close(linger=1000)
        ctx.term()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
        if p.is_alive():
            p.kill()
