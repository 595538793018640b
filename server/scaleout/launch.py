"""Starting N replicas behind the ingress on Ray Serve: `launch_replicas(...)` from Python, and
`radixlm serve --replicas N [--router prefix|round-robin] [--ray-address ADDR]` from a shell.

Ray: with no address (and no $RAY_ADDRESS) a private local Ray instance is started (no dashboard) and
stopped again on shutdown, SIGTERM and SIGINT included, leaving none of its processes running (a
watchdog process kills them if this process dies without stopping it); `--ray-address auto` joins one
already running on this machine, and shutdown only disconnects from a Ray this did not start. With
`--ray-address HOST:PORT` (a cluster made with `ray start --head` and `ray start --address HOST:PORT`
on the other machines) the replicas spread over its nodes; radixlm and the model must be installed on every node.
The public port (`--host`, `--port`) is Ray Serve's HTTP proxy on the head node.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from radixlm.server.scaleout.router import ROUTERS, RouterConfig
from radixlm.server.server_args import ServerArgs

logger = logging.getLogger("radixlm.server.scaleout")

APP_NAME = "radixlm"
HEALTH_CHECK_PERIOD_S = 2.0


@dataclass
class ScaleOutHandle:
    """Replicas started by launch_replicas: the ingress's base URL, and shutdown()."""

    url: str
    app_name: str
    replicas: int
    started_ray: bool
    started_serve: bool
    api_key: str | None = None
    private_ray: _PrivateRay | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def shutdown(self) -> None:
        """Deletes the application (each replica stops its server); stops Serve and Ray if this
        started them."""
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                try:
                    serve.delete(self.app_name)
                finally:
                    if self.started_serve or self.started_ray:
                        serve.shutdown()
        finally:
            if self.private_ray is not None:
                self.private_ray.shutdown()  # ray.shutdown(), then whatever of that Ray still runs
            elif self.started_ray:
                ray.shutdown()

    def __enter__(self) -> ScaleOutHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# The watchdog of a private Ray: records every process descending from the Ray processes this one
# started (argv[2:]); if this process (argv[1]) dies without saying "done" on the pipe, it kills them.
_WATCHDOG = r"""
import os, select, signal, sys
import psutil
parent, procs = int(sys.argv[1]), {}
for pid in map(int, sys.argv[2:]):
    try:
        procs[pid] = psutil.Process(pid)
    except psutil.Error:
        pass
def scan():
    for p in list(procs.values()):
        try:
            for q in p.children(recursive=True) if p.is_running() else ():
                procs.setdefault(q.pid, q)
        except psutil.Error:
            pass
said = b""
while os.getppid() == parent:
    if select.select([0], [], [], 1.0)[0]:
        data = os.read(0, 64)
        said += data
        if not data:
            break
    else:
        scan()
if b"done" not in said:
    scan()
    alive = [p for p in procs.values() if p.is_running()]
    for p in alive:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    for p in psutil.wait_procs(alive, timeout=2)[1]:
        try:
            p.kill()
        except psutil.Error:
            pass
"""

SHUTDOWN_GRACE_S = 2.0


class _PrivateRay:
    """The local Ray instance this process started (never one it joined). shutdown() runs
    ray.shutdown() and then SIGKILLs whatever of that instance still runs after a short grace: Ray
    does not guarantee it, and after an unclean stop (the GCS or raylet dying first, this process
    aborted or killed) the raylet's DashboardAgent and RuntimeEnvAgent live on for a minute or more,
    ignoring SIGTERM. Its processes: those ray.init() started here (GCS, raylet, dashboard head,
    monitors), their descendants (agents, workers, each replica's server) and any process naming its
    session dir; a watchdog process kills them if this process dies without calling shutdown()."""

    def __init__(self) -> None:
        import psutil

        # private: Ray has no public call that lists the processes ray.init() started
        from ray._private import worker

        node = worker._global_node
        self.session_dir: str = node.get_session_dir_path()
        self.procs: dict[int, Any] = {}
        for infos in node.all_processes.values():
            for info in infos:
                with contextlib.suppress(psutil.Error, AttributeError):
                    self.procs[info.process.pid] = psutil.Process(info.process.pid)
        self._lock = threading.Lock()
        self._stopped = False
        self.watchdog: subprocess.Popen | None = None
        try:
            self.watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), *map(str, self.procs)],
                                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            logger.warning("no watchdog for the private Ray (%s): if this process is killed, Ray's agents may "
                           "linger", e)
        atexit.register(self.shutdown)

    def collect(self) -> None:
        """Adds the descendants of the known processes, and processes naming the session dir."""
        import psutil

        for p in list(self.procs.values()):
            with contextlib.suppress(psutil.Error):
                for q in p.children(recursive=True) if p.is_running() else ():
                    self.procs.setdefault(q.pid, q)
        for q in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, TypeError):
                if self.session_dir in " ".join(q.info["cmdline"] or ()):
                    self.procs.setdefault(q.pid, q)
        for pid in (os.getpid(), self.watchdog and self.watchdog.pid):
            self.procs.pop(pid, None)

    def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        import psutil
        import ray

        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        try:
            self.collect()
            ray.shutdown(wait_for_processes=True)
        finally:
            self.collect()
            _, alive = psutil.wait_procs([p for p in self.procs.values() if _alive(p)], timeout=grace_s)
            alive = [p for p in alive if _alive(p)]
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    logger.info("killing %s (pid %d), left running by Ray", p.name(), p.pid)
                    p.kill()
            psutil.wait_procs(alive, timeout=5)
            if self.watchdog is not None:
                with contextlib.suppress(OSError):
                    self.watchdog.stdin.write(b"done")
                    self.watchdog.stdin.close()
                try:
                    self.watchdog.wait(10)
                except subprocess.TimeoutExpired:
                    self.watchdog.kill()
                    self.watchdog.wait()
            atexit.unregister(self.shutdown)


def _alive(p: Any) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _init_ray(address: str | None) -> _PrivateRay | None:
    """Connects to Ray at `address` (or $RAY_ADDRESS; "auto" finds one running on this machine), or
    else starts a private local instance without a dashboard; returns that instance if this call
    started one (shutting it down stops all of its processes), else None."""
    import ray

    if ray.is_initialized():
        return None
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    address = address or os.environ.get("RAY_ADDRESS")
    try:
        if address:
            ray.init(address=address, log_to_driver=False)
            return None
        # no dashboard; Ray (2.60) has no switch for the raylet's DashboardAgent and RuntimeEnvAgent,
        # nor for the dashboard head's process (include_dashboard=False leaves it its usage-stats module)
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        return _PrivateRay()
    finally:
        # ray.init() replaces the SIGTERM handler (with sys.exit, and its C++ failure handler that
        # aborts the process): give back the caller's, e.g. the CLI's, which shuts down cleanly
        if main_thread and sigterm not in (None, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, sigterm)


def _running_serve_address() -> tuple[str, int] | None:
    """(host, port) of the HTTP proxy if Serve already runs on this Ray cluster (its options are
    fixed then: ours would be ignored), else None."""
    # private: Ray Serve has no public call that reads the running proxy's options
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    return None if client is None else (client.http_config.host, client.http_config.port)


def launch_replicas(replicas: int = 2, router: str = "prefix", ray_address: str | None = None,
                    router_config: RouterConfig | None = None, replica_cpus: float = 1.0, replica_gpus: float = 0.0,
                    env: dict[str, str] | None = None, app_name: str = APP_NAME,
                    **server_kwargs: Any) -> ScaleOutHandle:
    """Starts `replicas` RadixLM servers as Ray Serve deployments behind one ingress and returns once
    every replica accepts requests. `server_kwargs` are the usual server options (model, ...);
    `host`/`port` are the public ingress address (`port=0`: a free port). `replica_cpus`/`replica_gpus`
    are Ray resources per replica (give each replica its own GPU with replica_gpus=1); `env` is set
    in each replica before its server starts (e.g. {"OMP_NUM_THREADS": "1"})."""
    try:
        from ray import serve
    except ImportError as e:
        raise ImportError("scaling out needs Ray Serve, the optional extra: pip install 'radixlm[ray]'") from e

    from radixlm.server.scaleout.ingress import Ingress
    from radixlm.server.scaleout.replica import ReplicaServer

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    args = ServerArgs.from_kwargs(**server_kwargs)
    port = args.port or _free_port(args.host)
    per_replica = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("host", "port")}
    private_ray = _init_ray(ray_address)
    started_ray = private_ray is not None
    running: tuple[str, int] | None = ("", 0)  # until known: not ours to shut down
    try:
        running = _running_serve_address()
        if running is None:
            serve.start(http_options={"host": args.host, "port": port}, proxy_location="HeadOnly")
        else:
            logger.warning("Ray Serve already runs on this cluster with its proxy on %s:%d; serving there", *running)
            port = running[1]
        capacity = args.max_running_requests + args.max_queued_requests  # the server answers 503 past this
        bound = [
            serve.deployment(ReplicaServer, name=f"radixlm-replica-{i}", num_replicas=1,
                             max_ongoing_requests=capacity, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                             ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus}
                             ).bind(i, per_replica, env)
            for i in range(replicas)
        ]
        ingress = serve.deployment(Ingress, name="radixlm-ingress", num_replicas=1,
                                   max_ongoing_requests=capacity * replicas, ray_actor_options={"num_cpus": 0})
        config = dataclasses.asdict(router_config or RouterConfig())
        serve.run(ingress.bind(bound, router, config, args.api_key, args.max_request_bytes),
                  name=app_name, route_prefix="/")
    except BaseException:
        try:
            if running is None:
                serve.shutdown()
        finally:
            if private_ray is not None:
                private_ray.shutdown()
        raise
    host = args.host if running is None else running[0]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard bind is reachable on loopback
    host = "[" + host + "]" if ":" in host else host
    return ScaleOutHandle(f"http://{host}:{port}", app_name, replicas, started_ray, running is None, args.api_key,
                          private_ray)


# ----------------------------------------------------------------------- CLI
def add_scaleout_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale-out on Ray Serve (pip install 'radixlm[ray]')")
    group.add_argument("--replicas", type=int, default=0,
                       help="run N replicas on Ray Serve behind one ingress (0: one plain server, no Ray)")
    group.add_argument("--router", choices=ROUTERS, default="prefix", help="how the ingress picks a replica")
    group.add_argument("--ray-address", default=None, help="join this Ray cluster (default: local Ray)")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica")
    group.add_argument("--replica-gpus", type=float, default=0.0, help="Ray GPUs per replica (1: one GPU each)")


def serve_replicas(args: ServerArgs, ns: argparse.Namespace) -> int:
    """The CLI's scale-out mode: start, print the URL, run until SIGINT/SIGTERM, stop."""
    try:
        import ray  # noqa: F401
    except ImportError:
        logger.error("--replicas needs Ray Serve: pip install 'radixlm[ray]'")
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    serving = False
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()
        if not serving:
            raise KeyboardInterrupt  # still starting: launch_replicas stops what it started

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        handle = launch_replicas(ns.replicas, ns.router, ns.ray_address, replica_cpus=ns.replica_cpus,
                                 replica_gpus=ns.replica_gpus, **dataclasses.asdict(args))
    except KeyboardInterrupt:
        if not received:
            raise
        logger.warning("stopped by signal %d while starting", received[0])
        return 128 + received[0]
    serving = True
    try:
        logger.info("RadixLM: %d replica(s), %s routing, at %s", ns.replicas, ns.router, handle.url)
        print(f"RadixLM serving {args.served_model_name or args.model} on {ns.replicas} replica(s) at {handle.url}",
              flush=True)
        stop.wait()
    finally:
        handle.shutdown()
    return 0
