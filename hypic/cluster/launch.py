"""``hypic serve --dp-size N``: the replicated service as a Ray Serve application. The replicas are
one deployment of N whole instances, routed by ``ReplicaRouter``; the ingress deployment is
HYPIC's HTTP application over ``ReplicaLoop``. Ray Serve's proxy listens on ``--host:--port``."""
import argparse
import asyncio
import logging
import signal
import threading
from pathlib import Path
from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.serve.config import HTTPOptions, ProxyLocation, RequestRouterConfig

from ..errors import HypicError
from ..router.pool import start_ray, stop_ray
from ..server.app import build_app
from ..server.gate import GateLimits
from .front import FrontEngine
from .ingress import ReplicaLoop, ReplicaRouter
from .replica import Replica
from .routing import policy_named
from .state import ClusterState, register_state

log = logging.getLogger("hypic.cluster")
APP_NAME = "hypic"
STATE_NAME = "hypic-ingress"  # the name the router finds the ingress's cluster state by
START_TIMEOUT_S = 600.0  # replicas load their model in this long, or the service does not start
MAX_ONGOING_PER_REPLICA = 1024  # the replicas' own loops queue and refuse (503) beyond their limits


@serve.ingress()
class Ingress:
    """HYPIC's HTTP application, in front of the replicas."""

    async def __init__(self, replicas: Any, args: argparse.Namespace, limits: GateLimits, info: Any) -> None:
        front = FrontEngine(Path(info.model_path), args.dtype, args.device, args.seam_width, args.pic_separator,
                            args.snapshot_interval)
        self.state = ClusterState(policy_named(args.router_policy))
        register_state(STATE_NAME, self.state)
        self.loop = ReplicaLoop(front, replicas, self.state, args.mode, args.max_state_memory,
                                spreads=args.tp_size == 1 and args.router_policy == "cache_aware")
        await self.loop.wait_for_replicas(args.dp_size, START_TIMEOUT_S)
        self.args, self.limits, self.info = args, limits, info

    def __serve_build_asgi_app__(self) -> Any:
        return OnServingLoop(build_app(self.loop, self.info, None, self.limits), self.loop.serve_on)


class OnServingLoop:
    """An ASGI app that first tells ``serve_on`` which event loop serves it (Ray Serve may build a
    deployment on another loop than the one its requests run on)."""

    def __init__(self, app: Any, serve_on: Callable[[asyncio.AbstractEventLoop], None]) -> None:
        self.app, self.serve_on = app, serve_on

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.serve_on(asyncio.get_running_loop())
        await self.app(scope, receive, send)


def application(args: argparse.Namespace, start_instance: Callable[..., Any], limits: GateLimits,
                info: Any) -> Any:
    """The bound Ray Serve application of ``hypic serve ARGS`` with ``--dp-size`` replicas."""
    replicas = serve.deployment(Replica, name="HypicReplica").options(
        num_replicas=args.dp_size, max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        ray_actor_options={"num_cpus": (args.threads or 1) * args.tp_size},
        health_check_period_s=1, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(request_router_class=ReplicaRouter,
                                                  request_router_kwargs={"state": STATE_NAME}))
    # the ingress runs on this node (the one ``hypic serve`` runs on): a node with replicas alone may go
    here = {f"node:{ray.util.get_node_ip_address()}": 0.001}
    ingress = serve.deployment(Ingress, name="HypicIngress").options(
        num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0, "resources": here})
    return ingress.bind(replicas.bind(args, start_instance), args, limits, info)


def serve_cluster(args: argparse.Namespace, start_instance: Callable[..., Any], limits: GateLimits, info: Any) -> None:
    """Run the service until SIGINT or SIGTERM, then stop it and the Ray runtime it started."""
    threads = args.threads or 1
    args.threads = threads
    start_ray(args.dp_size * threads * args.tp_size + 1, args.ray_address)
    try:
        # one proxy, on this node: --host is this machine's address (another node's proxy could not bind it)
        serve.start(http_options=HTTPOptions(host=args.host, port=args.port), proxy_location=ProxyLocation.HeadOnly,
                    logging_config={"log_level": "WARNING"})
        serve.run(application(args, start_instance, limits, info), name=APP_NAME, route_prefix="/", blocking=False)
        print(f"hypic: serving {info.served_model_name} with {args.dp_size} replicas ({args.router_policy} "
              f"routing) on http://{args.host}:{args.port}", flush=True)
        _wait_for_signal()
    except ray.exceptions.RayError as err:
        raise HypicError(f"the replicas could not start: {type(err).__name__}: {err}") from err
    finally:
        serve.shutdown()
        stop_ray()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
