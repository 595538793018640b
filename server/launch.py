"""Process wiring: `serve()` runs the HTTP process (uvicorn + TokenizerManager) and its two
children; `launch_server()` runs `serve()` in a child of its own and returns a handle.

    HTTP process (main thread: uvicorn)       scheduler process        detokenizer process
      TokenizerManager --GenerateReq/Abort--> Scheduler loop --TokenBatch--> Detokenizer
             ^-------------------------------------TextBatch------------------------|

Sockets are `ipc://` files in a private `tempfile.mkdtemp` folder (unique per server). Children are
started with the `spawn` context and get plain dicts (ServerArgs as a dict) as arguments; their
readiness (or load error) comes back as JSON over a pipe. A child that dies fails the requests in
flight (500), and both children are started again (new requests get 503 meanwhile); past
MAX_RESTARTS deaths within RESTART_WINDOW_S, or if the restart fails, the server exits with a log
line naming the child. A child whose parent dies (even by kill -9) stops and removes the ipc
folder (server/parent_watch.py). SIGTERM drains in-flight requests for `drain_timeout` seconds,
ends what is left with a final 503 error (JSON, or an SSE error event and [DONE]), then exits.
Connections get `header_timeout` seconds to send each request head (_head_timeout_protocol).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn

from radixlm.server import torch_free
from radixlm.server.children import (
    STARTUP_TIMEOUT_S,
    ServerStartError,
    spawn_context,
    start_children,
    stop_children,
    wait_ready,
)
from radixlm.server.logging_setup import setup_logging
from radixlm.server.server_args import ServerArgs

logger = logging.getLogger("radixlm.server")

DRAIN_GRACE_S = 10  # after the drain window: time for handlers to write their final errors
MAX_RESTARTS = 3  # child deaths within RESTART_WINDOW_S that are restarted; one more takes the server down
RESTART_WINDOW_S = 600


def resolve_api_key(args: ServerArgs) -> ServerArgs:
    try:
        return args.with_api_key_resolved()
    except ValueError as e:
        raise ServerStartError(str(e)) from e


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(args: ServerArgs, ready_conn=None) -> int:
    """Runs the server in this process until SIGTERM/SIGINT or a child's death; returns an exit code.
    `ready_conn` (a pipe end) receives {"ok", "url"} as JSON once requests are accepted. The entry points
    of a server's own process (the CLI, `launch_server`'s child) block torch before calling it."""
    setup_logging(args.log_level, "http")
    workdir = tempfile.mkdtemp(prefix="radixlm-")
    addrs = {name: f"ipc://{os.path.join(workdir, name)}" for name in ("scheduler", "detokenizer", "tokenizer")}
    procs: list = []
    exit_code = 0
    try:
        args = resolve_api_key(args)
        info, procs, tokenizer = start_children(args, addrs, meanwhile=_import_http_side)
        from radixlm.server.app import create_app
        from radixlm.server.metrics import Metrics
        from radixlm.server.tokenizer_manager import TokenizerManager

        sock = _bind(args.host, args.port)
        host, port = sock.getsockname()[:2]
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        served = args.served_model_name or args.model
        tm = TokenizerManager(args, info, addrs, Metrics(served), tokenizer)
        app = create_app(tm, served)
        # Everything loaded so far lives as long as the process: out of the cyclic collector's sight,
        # a full collection (triggered by a request body's many dicts, on whichever thread allocates
        # them) walks only request objects, instead of holding the GIL, and /health, for the whole heap.
        gc.freeze()

        http = _head_timeout_protocol(args.header_timeout) if args.header_timeout else "auto"
        server = _Server(uvicorn.Config(app, http=http, log_level=args.log_level, access_log=args.log_level == "debug",
                                        timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE_S), app)
        died = threading.Event()

        def report_ready() -> None:
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                logger.info("RadixLM serving %s at %s", served, url)
                if ready_conn is not None:
                    ready_conn.send_bytes(json.dumps({"ok": True, "url": url}).encode())

        threading.Thread(target=_watch_children, args=(server, tm, args, addrs, procs, died), name="radixlm-watchdog",
                         daemon=True).start()
        threading.Thread(target=report_ready, name="radixlm-ready", daemon=True).start()
        # uvicorn re-raises the signal it handled once it is done; make that a no-op so cleanup runs
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
        exit_code = 1 if died.is_set() else 0
    except ServerStartError as e:
        logger.error("%s", e)
        if ready_conn is not None:
            ready_conn.send_bytes(json.dumps({"ok": False, "error": str(e)}).encode())
        exit_code = 1
    finally:
        stop_children(procs, addrs)
        shutil.rmtree(workdir, ignore_errors=True)
    return exit_code


def _import_http_side() -> None:
    """The HTTP side's modules, imported while the scheduler loads rather than before it starts."""
    import radixlm.server.app  # noqa: F401


def _watch_children(server: _Server, tm, args: ServerArgs, addrs: dict[str, str], procs: list,
                    died: threading.Event) -> None:
    """The watchdog thread. A child that dies fails the requests in flight and both children are
    started again (the detokenizer holds state for the lost requests: a fresh pair starts clean);
    past MAX_RESTARTS deaths in RESTART_WINDOW_S, or when the restart fails, the server shuts down
    (sets `died`). Never a silent hang. `procs` is updated in place: serve() stops what it holds."""
    parent = multiprocessing.parent_process()  # launch_server's caller, if any
    restarts: list[float] = []
    while True:
        watched = [p.sentinel for p in procs] + ([parent.sentinel] if parent is not None else [])
        ready = multiprocessing.connection.wait(watched)
        if server.should_exit:
            return
        if parent is not None and parent.sentinel in ready:
            logger.error("the process that launched this server is gone; shutting down")
            server.should_exit = True
            return
        dead = [p for p in procs if p.sentinel in ready]
        for p in dead:
            p.join(1)  # its sentinel can fire before its exit code is there to read
        names = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
        if len(restarts) < MAX_RESTARTS:
            logger.error("%s died; failing the requests in flight and restarting it", names)
            server.on_loop(tm.fail_all, f"{names} died; it is being restarted: retry the request")
            try:
                stop_children(procs, None, timeout=0.0)  # the survivor too, at once: a fresh pair starts clean
                new = start_children(args, addrs, tm.tokenizer)[1]
            except ServerStartError as e:
                logger.error("restarting failed: %s", e)
            else:
                if server.should_exit:
                    stop_children(new, addrs)
                    return
                procs[:] = new
                restarts.append(now)
                tm.metrics.restarts.inc()
                server.on_loop(tm.resume)
                logger.info("scheduler and detokenizer restarted; serving again")
                continue
        else:
            logger.error("%s died, after %d restarts in the last %ds", names, len(restarts), RESTART_WINDOW_S)
        logger.error("shutting the server down")
        server.on_loop(tm.fail_all, f"{names} died; the server is shutting down")
        died.set()
        server.should_exit = True
        return


def _head_timeout_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools or h11, whichever it picks) with a deadline on each request
    head. uvicorn itself times out only idle keep-alive connections: one that sent part of a request
    line or headers, then nothing, is held open forever, a descriptor each. Both
    implementations set `cycle` the moment a head is complete; that is what the deadline waits for."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeadTimeoutProtocol(AutoHTTPProtocol):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self._deadline: asyncio.TimerHandle | None = None
            self._waiting_for: Any = None  # the cycle current when the deadline was set: a new one ends the wait

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._set_deadline()

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._set_deadline()  # the first bytes of a next request on a keep-alive connection
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._waiting_for:
                self._clear_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._clear_deadline()
            super().connection_lost(exc)

        def _set_deadline(self) -> None:
            self._waiting_for = self.cycle
            self._deadline = self.loop.call_later(timeout, self._expired)

        def _clear_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.cycle is self._waiting_for and not self.transport.is_closing():
                logger.debug("closing a connection from %s: no complete request head within %gs", self.client,
                             timeout)
                self.transport.close()

    return HeadTimeoutProtocol


class _Server(uvicorn.Server):
    """On the first SIGTERM/SIGINT: marks the app as draining (new requests get 503) and starts the
    drain (in-flight requests finish, or get a final 503 when the window ends); exposes its event
    loop to the watchdog thread."""

    def __init__(self, config: uvicorn.Config, app):
        super().__init__(config)
        self.app = app
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig, frame) -> None:
        if not self.app.state.draining and self.loop is not None:
            tm = self.app.state.tm
            logger.info("signal %d: draining %d in-flight generation(s) (up to %gs), then exiting", sig,
                        len(tm.states), tm.args.drain_timeout)
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(tm.drain(tm.args.drain_timeout)))
        self.app.state.draining = True
        super().handle_exit(sig, frame)

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def on_loop(self, fn, *args: Any) -> None:
        """fn(*args) on the event loop, from another thread (in call order); dropped if the loop has not
        started yet (nothing can be in flight then)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(fn, *args)


def _server_main(args_dict: dict, ready_conn) -> None:
    torch_free.block_torch()
    code = serve(ServerArgs(**args_dict), ready_conn)
    raise SystemExit(code)


@dataclass
class ServerHandle:
    """A server started by launch_server: its base URL, and shutdown()."""

    url: str
    process: Any
    api_key: str | None = None
    drain_timeout: float = 60.0

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def shutdown(self, timeout: float | None = None) -> int | None:
        """SIGTERM (drain, then exit); killed if it outlives `timeout` (default: the drain window plus
        a margin). Returns the exit code."""
        timeout = self.drain_timeout + DRAIN_GRACE_S + 15 if timeout is None else timeout
        p = self.process
        if p.is_alive():
            p.terminate()
            p.join(timeout)
            if p.is_alive():
                logger.error("server did not exit within %.0fs; killing it", timeout)
                p.kill()
                p.join(5)
        return p.exitcode

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def launch_server(**kwargs: Any) -> ServerHandle:
    """Starts a server (same option names as the CLI and Engine) in a child process and returns once
    it accepts requests. `port=0` picks a free port; see `handle.url`."""
    return launch(ServerArgs.from_kwargs(**kwargs))


def launch(args: ServerArgs, target=_server_main) -> ServerHandle:
    """launch_server's body; `target(args_dict, ready_conn)` runs the server process (tests pass a
    wrapper of _server_main that injects faults)."""
    args = resolve_api_key(args)  # the handle knows the key, wherever it came from
    ctx = spawn_context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(dataclasses.asdict(args), send), name="radixlm-server")
    proc.start()
    send.close()
    try:
        info = wait_ready(recv, proc, "server", STARTUP_TIMEOUT_S)
    except BaseException:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        raise
    return ServerHandle(info["url"], proc, args.api_key, args.drain_timeout)
