"""Ray Serve's own cost per request on this machine, against a direct call and a plain uvicorn server.

The replica method is trivial (a small dict, or 8 small chunks), so only the machinery is timed:

* ``direct``: the function called in-process;
* ``uvicorn``: a FastAPI app under uvicorn in its own process calling the same function (what
  ``hypic serve`` is today);
* ``serve-*``: HTTP -> Serve proxy -> ingress deployment (FastAPI via ``@serve.ingress``, 1 replica)
  -> ``DeploymentHandle`` -> replica deployment (2 replicas), with Serve's default router or a
  minimal custom ``RequestRouter``, and with the ``RAY_SERVE_*`` settings that change the path.

Three endpoints on every server: ``/noop`` answers without calling anything (HTTP + proxy + ingress),
``/reply`` calls the function (through the handle under Serve) and reports that call's time as the
server saw it, ``/stream`` streams 8 chunks plus a trailer line with the server-side times to the
first and last chunk. The client (httpx, keep-alive, sequential requests) times every request;
warm-up requests are excluded. Each configuration starts a fresh local Ray (settings are read
when Serve's processes start) and is measured ``--runs`` times; the table holds medians of the
runs' p50/p99.

    python eval/bench_serve_overhead.py --requests 300 --runs 3 --json eval/results/serve_overhead.json
"""
import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Optional

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray.serve.request_router import RequestRouter

from hypic.net import free_port

CHUNKS = 8


def work(text: str) -> dict:
    """The trivial replica body: a small dict."""
    return {"text": text, "tokens": len(text)}


def chunks(text: str) -> Iterator[dict]:
    """The trivial streaming body: 8 small chunks."""
    for index in range(CHUNKS):
        yield {"index": index, "text": text}


def ms_since(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


# ---------------------------------------------------------------- plain uvicorn (in-process call)

plain_app = FastAPI()


@plain_app.get("/noop")
async def plain_noop() -> dict:
    return {}


@plain_app.get("/reply")
async def plain_reply(text: str = "hello") -> dict:
    start = time.perf_counter()
    result = work(text)
    return {"result": result, "call_ms": ms_since(start)}


async def ndjson_with_trailer(parts: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Each part as one JSON line, then a trailer with the server-side first/last chunk times."""
    start, first_ms = time.perf_counter(), None
    async for part in parts:
        first_ms = first_ms if first_ms is not None else ms_since(start)
        yield (json.dumps(part) + "\n").encode()
    yield (json.dumps({"trailer": {"first_ms": first_ms, "last_ms": ms_since(start)}}) + "\n").encode()


async def local_chunks(text: str) -> AsyncIterator[dict]:
    for part in chunks(text):
        yield part


@plain_app.get("/stream")
async def plain_stream(text: str = "hello") -> StreamingResponse:
    return StreamingResponse(ndjson_with_trailer(local_chunks(text)), media_type="application/x-ndjson")


def run_plain_server(port: int) -> None:
    import uvicorn
    uvicorn.run(plain_app, host="127.0.0.1", port=port, log_level="warning")


# ---------------------------------------------------------------- client side timing

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "p99": percentile(values, 0.99), "n": len(values)}


def time_json(client: httpx.Client, url: str, count: int) -> tuple[list[float], list[dict]]:
    latencies, bodies = [], []
    for _ in range(count):
        start = time.perf_counter()
        answer = client.get(url)
        latencies.append(ms_since(start))
        answer.raise_for_status()
        bodies.append(answer.json())
    return latencies, bodies


def time_stream(client: httpx.Client, url: str, count: int) -> tuple[list[float], list[float], list[dict]]:
    """Client times to the first data byte and to the last data chunk (before the trailer)."""
    firsts, lasts, trailers = [], [], []
    for _ in range(count):
        start = time.perf_counter()
        with client.stream("GET", url) as answer:
            answer.raise_for_status()
            first, seen, trailer = None, 0, None
            for line in answer.iter_lines():
                first = first if first is not None else ms_since(start)
                part = json.loads(line)
                if "trailer" in part:
                    trailer = part["trailer"]
                else:
                    seen += 1
                    last = ms_since(start)
        assert seen == CHUNKS and trailer is not None, (seen, trailer)
        firsts.append(first)
        lasts.append(last)
        trailers.append(trailer)
    return firsts, lasts, trailers


def measure_server(base: str, requests: int, warmup: int) -> dict:
    """One run against a server: /noop, /reply and /stream, each warmed up then timed."""
    with httpx.Client(base_url=base, timeout=30.0) as client:
        time_json(client, "/noop", warmup)
        noop, _ = time_json(client, "/noop", requests)
        time_json(client, "/reply?text=hello", warmup)
        reply, bodies = time_json(client, "/reply?text=hello", requests)
        time_stream(client, "/stream?text=hello", warmup)
        first, last, trailers = time_stream(client, "/stream?text=hello", requests)
    replicas: dict[str, int] = {}
    for body in bodies:
        replicas[body["result"].get("replica", "-")] = replicas.get(body["result"].get("replica", "-"), 0) + 1
    return {
        "noop_ms": summary(noop), "reply_ms": summary(reply),
        "call_in_server_ms": summary([body["call_ms"] for body in bodies]),
        "replica_body_ms": summary([body["result"].get("body_ms", 0.0) for body in bodies]),
        "stream_first_ms": summary(first), "stream_last_ms": summary(last),
        "stream_first_in_server_ms": summary([t["first_ms"] for t in trailers]),
        "stream_last_in_server_ms": summary([t["last_ms"] for t in trailers]),
        "reply_replicas": replicas,
    }


def measure_direct(requests: int, warmup: int) -> dict:
    for _ in range(warmup):
        work("hello")
    calls = []
    for _ in range(requests):
        start = time.perf_counter()
        work("hello")
        calls.append(ms_since(start))
    firsts, lasts = [], []
    for _ in range(requests):
        start = time.perf_counter()
        for index, _part in enumerate(chunks("hello")):
            if index == 0:
                firsts.append(ms_since(start))
        lasts.append(ms_since(start))
    return {"reply_ms": summary(calls), "stream_first_ms": summary(firsts), "stream_last_ms": summary(lasts)}


def wait_for_http(base: str, deadline_s: float) -> float:
    """Seconds until ``base``/noop answers 200; raises after the deadline."""
    start = time.perf_counter()
    while time.perf_counter() - start < deadline_s:
        try:
            if httpx.get(base + "/noop", timeout=2.0).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base}/noop did not answer within {deadline_s} s")


def measure_plain(args: argparse.Namespace) -> dict:
    port = free_port()
    process = multiprocessing.get_context("spawn").Process(target=run_plain_server, args=(port,), daemon=True)
    process.start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_http(base, 60.0)
        return {"runs": [measure_server(base, args.requests, args.warmup) for _ in range(args.runs)]}
    finally:
        process.terminate()
        process.join(10)
        if process.is_alive():
            process.kill()


# ---------------------------------------------------------------- Ray Serve

class RankedRouter(RequestRouter):
    """A minimal custom router: every candidate, ranked by (cached queue length, a hash of the
    request id and replica id), one replica per rank. It records what Serve hands it. Serve turns
    a router class into a ``module.Name`` path and imports it, so it must live at module level."""

    def initialize_state(self, facts_path: str = "", **kwargs: Any) -> None:
        self.facts_path = facts_path
        self.facts: dict = {"calls": 0, "choose_us_total": 0.0, "pending_none": 0, "first_calls": []}

    def score(self, replica: Any, request_id: str) -> tuple:
        queue_len = self.replica_queue_len_cache.get(replica.replica_id) or 0
        salt = hashlib.blake2b(f"{request_id}{replica.replica_id.unique_id}".encode(), digest_size=4)
        return (queue_len, salt.hexdigest())

    async def choose_replicas(self, candidate_replicas: list, pending_request: Optional[Any] = None) -> list:
        start = time.perf_counter()
        request_id = pending_request.metadata.request_id if pending_request is not None else ""
        ranked = sorted(candidate_replicas, key=lambda replica: self.score(replica, request_id))
        self.facts["choose_us_total"] += (time.perf_counter() - start) * 1e6
        self.record(candidate_replicas, pending_request)
        return [[replica] for replica in ranked]

    def record(self, candidates: list, pending_request: Optional[Any]) -> None:
        # Facts go to a file the driver reads: the router lives in the ingress's process.
        self.facts["calls"] += 1
        self.facts["pending_none"] += pending_request is None
        if len(self.facts["first_calls"]) < 3:
            self.facts["first_calls"].append(describe_call(candidates, pending_request))
        if self.facts["calls"] <= 3 or self.facts["calls"] % 10 == 0:
            Path(self.facts_path).write_text(json.dumps(self.facts, default=repr))


def describe_call(candidates: list, pending_request: Optional[Any]) -> dict:
    metadata = pending_request.metadata if pending_request is not None else None
    return {
        "candidates": [{"replica_id": str(r.replica_id), "max_ongoing_requests": r.max_ongoing_requests}
                       for r in candidates],
        "pending_request_type": type(pending_request).__name__,
        "args": repr(pending_request.args)[:300] if pending_request is not None else None,
        "kwargs": repr(pending_request.kwargs)[:300] if pending_request is not None else None,
        "resolved": getattr(pending_request, "resolved", None),
        "call_method": getattr(metadata, "call_method", None),
        "is_streaming": getattr(metadata, "is_streaming", None),
        "request_id": getattr(metadata, "request_id", None),
        "thread": __import__("threading").current_thread().name,
    }


def build_serve_app(custom_router: bool, facts_path: str) -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.handle import DeploymentHandle

    router_options = {}
    if custom_router:
        router_options["request_router_config"] = RequestRouterConfig(
            request_router_class=RankedRouter, request_router_kwargs={"facts_path": facts_path})

    @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1}, **router_options)
    class Replica:
        def __init__(self) -> None:
            self.replica = serve.get_replica_context().replica_id.unique_id

        async def reply(self, text: str) -> dict:
            start = time.perf_counter()
            result = work(text)
            return {**result, "replica": self.replica, "body_ms": ms_since(start)}

        async def stream(self, text: str) -> AsyncIterator[dict]:
            for part in chunks(text):
                yield part

    ingress_app = FastAPI()

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 1})
    @serve.ingress(ingress_app)
    class Ingress:
        def __init__(self, replica: DeploymentHandle) -> None:
            self.replica = replica

        @ingress_app.get("/noop")
        async def noop(self) -> dict:
            return {}

        @ingress_app.get("/reply")
        async def reply(self, text: str = "hello") -> dict:
            start = time.perf_counter()
            result = await self.replica.reply.remote(text)
            return {"result": result, "call_ms": ms_since(start)}

        @ingress_app.get("/stream")
        async def stream(self, text: str = "hello") -> StreamingResponse:
            parts = self.replica.options(stream=True).stream.remote(text)
            return StreamingResponse(ndjson_with_trailer(parts), media_type="application/x-ndjson")

    return Ingress.bind(Replica.bind())


SESSIONS: list[str] = []  # this script's Ray session directories, to tell its processes from others'


def own_ray_processes() -> list[str]:
    """Live processes that belong to one of this script's Ray sessions (by command line or an
    open file under the session directory): other engineers' Ray clusters on the box are left out."""
    leftovers = []
    for pid in (entry for entry in os.listdir("/proc") if entry.isdigit() and int(entry) != os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(session in cmdline or any(link.startswith(session) for link in links) for session in SESSIONS):
            leftovers.append(f"{pid} {cmdline[:120]}")
    return leftovers


def foreign_ray_running() -> bool:
    own = {line.split()[0] for line in own_ray_processes()}
    names = subprocess.run(["ps", "-eo", "pid,stat,comm"], capture_output=True, text=True).stdout.splitlines()
    return any(line.split()[2] == "raylet" and "Z" not in line.split()[1] and line.split()[0] not in own
               for line in names[1:])


def wait_for_quiet_box(max_wait_s: float) -> dict:
    """The box is shared: wait (bounded) until no other raylet runs and the 1-minute load is under 1."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait_s and (foreign_ray_running() or os.getloadavg()[0] >= 1.0):
        time.sleep(5)
    return {"waited_s": time.perf_counter() - start, "load_1min": os.getloadavg()[0],
            "foreign_ray": foreign_ray_running()}


def find_direct_ingress(low: int, high: int, deadline_s: float) -> str:
    """With direct ingress the ingress replica itself listens on a port in [low, high)."""
    start = time.perf_counter()
    while time.perf_counter() - start < deadline_s:
        for port in range(low, high):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/noop", timeout=0.5).status_code == 200:
                    return f"http://127.0.0.1:{port}"
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"no ingress replica answered on ports {low}-{high}")


def kill_one_replica(base: str, deadline_s: float = 90.0) -> dict:
    """Kills one ``Replica`` actor and keeps asking the ingress (a request every 50 ms) until a
    replica that did not exist before answers: what the handle does meanwhile, and how long Serve
    takes to put a fresh replica into service."""
    import ray

    actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#Replica#" in a["name"]]
    before = {actor["name"].rsplit("#", 1)[1] for actor in actors}
    victim = actors[0]
    killed_at = time.perf_counter()
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    answers, replaced_s = [], None
    with httpx.Client(base_url=base, timeout=30.0) as client:
        while replaced_s is None and time.perf_counter() - killed_at < deadline_s:
            start = time.perf_counter()
            answer = client.get("/reply?text=hello")
            replica = answer.json()["result"]["replica"] if answer.status_code == 200 else answer.text[:200]
            answers.append({"at_s": start - killed_at, "status": answer.status_code, "ms": ms_since(start),
                            "replica": replica})
            if answer.status_code == 200 and replica not in before:
                replaced_s = time.perf_counter() - killed_at
            time.sleep(0.05)
    statuses: dict = {}
    for answer in answers:
        statuses[str(answer["status"])] = statuses.get(str(answer["status"]), 0) + 1
    return {"victim": victim["name"], "replicas_before": sorted(before), "first_answers": answers[:5],
            "slowest_answer_ms": max(answer["ms"] for answer in answers), "statuses": statuses,
            "answers_to_victim": sum(answer["replica"] == victim["name"].rsplit("#", 1)[1] for answer in answers),
            "new_replica_serving_after_s": replaced_s}


def measure_serve(name: str, env: dict, custom_router: bool, args: argparse.Namespace,
                  kill_probe: bool = False) -> dict:
    """One configuration on a fresh local Ray; ``env`` is set before Ray starts so every Serve
    process (controller, proxy, replicas) reads it."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    import ray
    from ray import serve
    facts_path = str(Path(args.scratch) / f"router-facts-{name}.json")
    result: dict = {"env": env, "custom_router": custom_router}
    try:
        start = time.perf_counter()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        result["ray_init_s"] = time.perf_counter() - start
        SESSIONS.append(ray._private.worker._global_node.get_session_dir_path())
        port = free_port()
        start = time.perf_counter()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        result["serve_start_s"] = time.perf_counter() - start
        start = time.perf_counter()
        serve.run(build_serve_app(custom_router, facts_path), name="app", route_prefix="/")
        result["deploy_s"] = time.perf_counter() - start
        if env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1" or env.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1":
            low = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
            base = find_direct_ingress(low, int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]), 60.0)
        else:
            base = f"http://127.0.0.1:{port}"
        result["base"] = base
        result["first_answer_s"] = wait_for_http(base, 60.0)
        result["runs"] = [measure_server(base, args.requests, args.warmup) for _ in range(args.runs)]
        if custom_router and Path(facts_path).exists():
            result["router_facts"] = json.loads(Path(facts_path).read_text())
        if kill_probe:
            result["kill_probe"] = kill_one_replica(base)
        return result
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


# ---------------------------------------------------------------- configurations and report

def serve_configs() -> list[tuple[str, dict, bool]]:
    port = free_port()  # direct ingress: the single ingress replica gets exactly this port (MAX is exclusive)
    direct_ports = {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
                    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1)}
    return [
        ("serve-default", {}, False),
        ("serve-custom-router", {}, True),
        ("serve-same-loop", {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                             "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}, False),
        ("serve-same-loop-custom-router", {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                                           "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}, True),
        ("serve-probe-every-request", {"RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S": "0"}, False),
        ("serve-grpc", {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}, False),
        ("serve-direct-ingress", {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", **direct_ports}, False),
        ("serve-throughput-optimized", {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", **direct_ports}, False),
        ("serve-throughput-optimized-custom-router", {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", **direct_ports}, True),
    ]


def median_of_runs(runs: list[dict], metric: str, stat: str) -> float:
    return statistics.median(run[metric][stat] for run in runs)


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "fma"]
    return {
        "model_name": fields.get("Model name", "").strip(), "cpus": os.cpu_count(),
        "isa": platform.machine(), "flags": [flag for flag in wanted if flag in flags],
        "python": sys.version.split()[0], "thread_env": {key: os.environ.get(key) for key in
                                                       ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAY_num_cpus")},
    }


def markdown_table(results: dict) -> str:
    """One row per server configuration: medians over runs of each run's p50 (p99 where named), ms.
    ``outside handle`` = reply - handle call: HTTP, proxy, ingress FastAPI and the response's way back."""
    plain = results["configs"]["uvicorn"]["runs"]
    plain_reply = median_of_runs(plain, "reply_ms", "p50")
    plain_last = median_of_runs(plain, "stream_last_ms", "p50")
    rows = ["| config | load | noop p50 | reply p50 | reply p99 | handle call p50 | outside handle p50 "
            "| stream 1st p50 | stream last p50 | stream last p99 | handle 1st / last p50 | reply x uvicorn "
            "| stream x uvicorn |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, config in results["configs"].items():
        runs = config.get("runs")
        if not runs or "noop_ms" not in runs[0]:
            continue
        cell = lambda metric, stat="p50": median_of_runs(runs, metric, stat)  # noqa: E731
        reply, call = cell("reply_ms"), cell("call_in_server_ms")
        rows.append(
            f"| {name} | {config.get('box', {}).get('load_1min', float('nan')):.1f} | {cell('noop_ms'):.2f} "
            f"| {reply:.2f} | {cell('reply_ms', 'p99'):.2f} | {call:.2f} | {reply - call:.2f} "
            f"| {cell('stream_first_ms'):.2f} | {cell('stream_last_ms'):.2f} | {cell('stream_last_ms', 'p99'):.2f} "
            f"| {cell('stream_first_in_server_ms'):.2f} / {cell('stream_last_in_server_ms'):.2f} "
            f"| {reply / plain_reply:.1f} | {cell('stream_last_ms') / plain_last:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="timed sequential requests per endpoint and run")
    parser.add_argument("--warmup", type=int, default=30, help="untimed requests per endpoint before each run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="serve configurations to run (default: all)")
    parser.add_argument("--first-wait", type=float, default=600, help="seconds to wait for a quiet box at the start")
    parser.add_argument("--max-wait", type=float, default=60, help="seconds to wait for a quiet box per config")
    parser.add_argument("--scratch", default="/tmp/bench_serve_overhead")
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--table-from", type=Path, help="only print the table of a saved --json file")
    args = parser.parse_args()
    if args.table_from:
        print(markdown_table(json.loads(args.table_from.read_text())))
        return
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "requests": args.requests, "warmup": args.warmup, "runs": args.runs,
                     "configs": {}}
    results["start_box"] = wait_for_quiet_box(args.first_wait)
    results["configs"]["direct"] = {"runs": [measure_direct(args.requests, args.warmup) for _ in range(args.runs)]}
    results["configs"]["uvicorn"] = {"box": wait_for_quiet_box(args.max_wait), **measure_plain(args)}
    for name, env, custom in serve_configs():
        if args.only and name not in args.only:
            continue
        box = wait_for_quiet_box(args.max_wait)
        try:
            results["configs"][name] = measure_serve(name, env, custom, args, kill_probe=name in ("serve-default", "serve-throughput-optimized"))
        except Exception as error:  # one failing configuration must not lose the others' numbers
            results["configs"][name] = {"env": env, "error": f"{type(error).__name__}: {error}"}
            print(f"{name}: {type(error).__name__}: {error}", file=sys.stderr)
        results["configs"][name]["box"] = box
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    time.sleep(2)  # Ray's processes exit shortly after ray.shutdown() returns
    results["ray_processes_left"] = own_ray_processes()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(markdown_table(results))
    print("ray processes left:", results["ray_processes_left"] or "none")


if __name__ == "__main__":
    main()
