"""Scale-out on Ray Serve (optional extra `radixlm[ray]`): N replicas, each one ordinary RadixLM
server, behind an ingress that routes every request to the replica most likely to hold its prefix.

    from radixlm.server.scaleout import launch_replicas
    handle = launch_replicas(replicas=2, router="prefix", model="smollm2-135m", port=0)
    ... handle.url ...            # every route of a single server, on one port
    handle.shutdown()

Modules (only replica.py, ingress.py and launch_replicas import Ray):
    prefix_tree.py      approximate character radix tree per replica, LRU-bounded
    router.py           prefix-aware routing with a load-balance fallback; round-robin; routing keys
    replica.py          the replica deployment: runs one server on loopback, forwards to it
    ingress.py          the ingress deployment: same routes on one port, /health, /metrics, failover
    ingress_metrics.py  the ingress's Prometheus metrics
    launch.py           launch_replicas() and the CLI's --replicas mode
"""

from radixlm.server.scaleout.launch import ScaleOutHandle, launch_replicas
from radixlm.server.scaleout.router import PrefixRouter, RoundRobinRouter, RouterConfig

__all__ = ["PrefixRouter", "RoundRobinRouter", "RouterConfig", "ScaleOutHandle", "launch_replicas"]
