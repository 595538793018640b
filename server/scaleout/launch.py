"""Starting N replicas behind the ingress on Ray Serve: `launch_replicas(...)` from Python, and
`radixlm serve --replicas N [--router prefix|round-robin] [--ray-address ADDR]` from a shell.

Ray: with no address (and no $RAY_ADDRESS) a private local Ray instance is started and stopped again
on shutdown; `--ray-address auto` joins one already running on this machine. With
`--ray-address HOST:PORT` (a cluster made with `ray start --head` and `ray start --address HOST:PORT`
on the other machines) the replicas spread over its nodes; radixlm and the model must be installed on every node.
The public port (`--host`, `--port`) is Ray Serve's HTTP proxy on the head node.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

from radixlm.runtime.server_args import ServerArgs
from radixlm.server.scaleout.router import ROUTERS, RouterConfig

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

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def shutdown(self) -> None:
        """Deletes the application (each replica stops its server); stops Serve and Ray if this
        started them."""
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            serve.delete(self.app_name)
        finally:
            if self.started_serve or self.started_ray:
                serve.shutdown()
            if self.started_ray:
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


def _init_ray(address: str | None) -> bool:
    """Connects to Ray at `address` (or $RAY_ADDRESS; "auto" finds one running on this machine), or
    else starts a private local instance; True if this call started one (shutdown stops it)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    return True


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
    from ray import serve

    from radixlm.server.scaleout.ingress import Ingress
    from radixlm.server.scaleout.replica import ReplicaServer

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    args = ServerArgs.from_kwargs(**server_kwargs)
    port = args.port or _free_port(args.host)
    per_replica = {k: v for k, v in dataclasses.asdict(args).items() if k not in ("host", "port")}
    started_ray = _init_ray(ray_address)
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
        import ray

        if running is None:
            serve.shutdown()
        if started_ray:
            ray.shutdown()
        raise
    host = args.host if running is None else running[0]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # a wildcard bind is reachable on loopback
    host = "[" + host + "]" if ":" in host else host
    return ScaleOutHandle(f"http://{host}:{port}", app_name, replicas, started_ray, running is None, args.api_key)


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
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    handle = launch_replicas(ns.replicas, ns.router, ns.ray_address, replica_cpus=ns.replica_cpus,
                             replica_gpus=ns.replica_gpus, **dataclasses.asdict(args))
    logger.info("RadixLM: %d replica(s), %s routing, at %s", ns.replicas, ns.router, handle.url)
    print(f"RadixLM serving {args.served_model_name or args.model} on {ns.replicas} replica(s) at {handle.url}",
          flush=True)
    try:
        stop.wait()
    finally:
        handle.shutdown()
    return 0
