"""``hypic serve --dp-size N``: the replicated service as a Ray Serve application. The replicas are
one deployment of N whole instances, routed by ``ReplicaRouter``; the ingress deployment is
HYPIC's HTTP application over ``ReplicaLoop``. ``hypic serve`` starts no Ray Serve proxy: the ingress
listens on ``--host:--port`` itself; deployed with ``serve run``, the application is reached through
Serve's proxy as any other."""
import argparse
import asyncio
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import ray
import uvicorn
from ray import serve
from ray.serve.config import ProxyLocation, RequestRouterConfig

from ..errors import HypicError
from ..router.pool import start_ray, stop_ray
from ..server.app import build_app
from ..server.gate import GateLimits
from .front import FrontEngine
from .ingress import ReplicaLoop, ReplicaRouter
from .logs import AccessLines, log_queue, print_relayed, relay_logs
from .replica import Replica
from .routing import FETCH_CREDIT, policy_named
from .slo import SloRefusal
from .state import ClusterState, register_state

log = logging.getLogger("hypic.cluster")
APP_NAME = "hypic"
STATE_NAME = "hypic-ingress"  # the name the router finds the ingress's cluster state by
START_TIMEOUT_S = 600.0  # replicas load their model in this long, or the service does not start
MAX_ONGOING_PER_REPLICA = 1024  # the replicas' own loops queue and refuse (503) beyond their limits
LISTEN_TIMEOUT_S = 30.0  # the ingress's own HTTP server accepts connections in this long, or it fails to start


@serve.ingress()
class Ingress:
    """HYPIC's HTTP application, in front of the replicas; with ``listen`` (host, port), also served on
    that address by this replica itself."""

    async def __init__(self, replicas: Any, args: argparse.Namespace, limits: GateLimits, info: Any,
                       listen: tuple[str, int] | None = None, logs: Any = None) -> None:
        access = logging.getLevelName(args.log_level.upper()) <= logging.INFO  # a line per request, as one server writes
        relay_logs(logs, "ingress", args.log_level)
        front = FrontEngine(Path(info.model_path), args.dtype, args.device, args.seam_width, args.pic_separator,
                            args.snapshot_interval)
        fetches = args.tp_size == 1 and args.router_policy in ("cache_aware", "ttft")  # a replica of shards: documents stay put
        self.state = ClusterState(policy_named(args.router_policy, **({"fetch_credit": FETCH_CREDIT} if fetches else {})))
        register_state(STATE_NAME, self.state)
        self.loop = ReplicaLoop(front, replicas, self.state, args.mode, args.max_state_memory,
                                spreads=fetches, refusal=SloRefusal(args.ttft_slo, args.tbt_slo),
                                silence_s=args.worker_timeout, ingresses=args.ingress_replicas)
        await self.loop.wait_for_replicas(args.dp_size, START_TIMEOUT_S)
        self.asgi = OnServingLoop(build_app(self.loop, info, None, limits), self.loop.serve_on)
        self.listener = None
        if listen is not None:  # several ingresses share the address (each its own socket, the kernel spreads them)
            self.listener = await Listener.start(self.asgi, *listen, shared=args.ingress_replicas > 1, access=access)

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi

    def check_health(self) -> None:
        """Ray Serve's health probe: an ingress no longer listening on its address is restarted."""
        if self.listener is not None:
            self.listener.check()

    def __del__(self) -> None:
        if getattr(self, "listener", None) is not None:
            self.listener.server.should_exit = True


@dataclass
class Listener:
    """``app`` served on an address from this process's event loop: a request goes from its client
    straight to the ingress, not through Ray Serve's proxy (a hop that cost about 9 ms of a 15 ms
    request, and CPU the replicas need, on a 2-core machine)."""

    address: str
    server: uvicorn.Server
    task: asyncio.Task

    @classmethod
    async def start(cls, app: Any, host: str, port: int, shared: bool = False, access: bool = False) -> "Listener":
        """Listening, or an error naming the address. The socket reuses the address: a restarted
        ingress takes its port back at once, while its predecessor's connections linger. ``shared``:
        other ingresses listen on the same port (SO_REUSEPORT: the kernel spreads new connections
        over the live ones); ``access``: a log line per request."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            sock.close()
            raise HypicError(f"the ingress cannot listen on {host}:{port}: {err}") from err
        app = AccessLines(app) if access else app
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False))
        listener = cls(f"{host}:{port}", server, asyncio.get_running_loop().create_task(server.serve(sockets=[sock])))
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not server.started:
            listener.check()
            if time.monotonic() > deadline:
                raise HypicError(f"the ingress's HTTP server did not start on {listener.address} in {LISTEN_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.01)
        return listener

    def check(self) -> None:
        if self.task.done():
            failure = None if self.task.cancelled() else self.task.exception()
            raise HypicError(f"the ingress stopped listening on {self.address}: {failure or 'its server exited'}")


class OnServingLoop:
    """An ASGI app that first tells ``serve_on`` which event loop serves it (Ray Serve may build a
    deployment on another loop than the one its requests run on)."""

    def __init__(self, app: Any, serve_on: Callable[[asyncio.AbstractEventLoop], None]) -> None:
        self.app, self.serve_on = app, serve_on

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.serve_on(asyncio.get_running_loop())
        await self.app(scope, receive, send)


def application(args: argparse.Namespace, start_instance: Callable[..., Any], limits: GateLimits,
                info: Any, listen: tuple[str, int] | None = None, logs: Any = None) -> Any:
    """The bound Ray Serve application of ``hypic serve ARGS`` with ``--dp-size`` replicas; ``listen``:
    the address its ingress serves HTTP on itself (none: only through Ray Serve's proxy); ``logs``:
    the queue its processes' log lines go to (``hypic.cluster.logs``)."""
    replicas = serve.deployment(Replica, name="HypicReplica").options(
        num_replicas=args.dp_size, max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        ray_actor_options={"num_cpus": (args.threads or 1) * args.tp_size},
        health_check_period_s=1, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(request_router_class=ReplicaRouter,
                                                  request_router_kwargs={"state": STATE_NAME}))
    # the ingress runs on this node (the one ``hypic serve`` runs on): it listens on --host, this machine's
    # address, and a node with replicas alone may go
    here = {f"node:{ray.util.get_node_ip_address()}": 0.001}
    ingress = serve.deployment(Ingress, name="HypicIngress").options(
        num_replicas=args.ingress_replicas, max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0, "resources": here})
    return ingress.bind(replicas.bind(args, start_instance, logs=logs), args, limits, info, listen, logs)


def serve_cluster(args: argparse.Namespace, start_instance: Callable[..., Any], limits: GateLimits, info: Any) -> None:
    """Run the service until SIGINT or SIGTERM, then stop it and the Ray runtime it started. A signal
    at any moment of the start stops it as well, once the step under way returns (each step is
    bounded: Ray's start, the replicas' within ``START_TIMEOUT_S``): whatever Ray started so far is
    ended and its session folder deleted."""
    threads = args.threads or 1
    args.threads = threads
    printed, serving, stop = threading.Event(), False, _stop_on_signals()
    try:
        start_ray(args.dp_size * threads * args.tp_size + 1, args.ray_address)
        serving = not stop.is_set() and _start_application(args, start_instance, limits, info, printed, stop)
        if serving:
            ingresses = f" and {args.ingress_replicas} ingresses" if args.ingress_replicas > 1 else ""
            print(f"hypic: serving {info.served_model_name} with {args.dp_size} replicas ({args.router_policy} "
                  f"routing){ingresses} on http://{args.host}:{args.port}", flush=True)
            while not stop.wait(1.0):  # woken by the signal's handler, on this thread
                pass
        print(f"hypic: {stop.cause}: stopping{'' if serving else ' the start'}", flush=True)
    except ray.exceptions.RayError as err:
        raise HypicError(f"the replicas could not start: {type(err).__name__}: {err}") from err
    finally:
        printed.set()
        if serving:
            serve.shutdown()
        stop_ray()


def _start_application(args: argparse.Namespace, start_instance: Callable[..., Any], limits: GateLimits, info: Any,
                       printed: threading.Event, stop: "StopSignal") -> bool:
    """Start Serve and the application on the Ray runtime this process joined; True once it runs,
    False where ``stop`` was set first."""
    logs = log_queue({f"node:{ray.util.get_node_ip_address()}": 0.001})
    print_relayed(logs, printed)
    # no proxy: the ingress (on this node) listens on --host:--port itself
    serve.start(proxy_location=ProxyLocation.Disabled, logging_config={"log_level": "WARNING"})
    serve._run(application(args, start_instance, limits, info, (args.host, args.port), logs), name=APP_NAME,
               route_prefix=None, _blocking=False)
    return _running(stop)


class StopSignal(threading.Event):
    """Set by SIGINT or SIGTERM; ``cause`` names the signal."""

    cause = ""


def _stop_on_signals() -> StopSignal:
    """SIGINT and SIGTERM set the returned event: the start checks it between its steps and the
    service waits on it, so no signal cuts into Ray's own calls."""
    stop = StopSignal()

    def on_signal(signum: int, _: Any) -> None:
        stop.cause = signal.Signals(signum).name
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return stop


def _running(stop: StopSignal) -> bool:
    """Wait until the application runs (True), or a stop signal (False); its deployment failing, or
    not running within ``START_TIMEOUT_S``, fails the start naming why."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not stop.wait(0.5):
        app = serve.status().applications.get(APP_NAME)
        status = app.status if app is not None else "NOT_STARTED"
        if status == "RUNNING":
            return True
        if status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise HypicError(f"the replicas could not start: {app.message}")
        if time.monotonic() > deadline:
            raise HypicError(f"the replicas did not start within {START_TIMEOUT_S:.0f} s (status {status})")
    return False
