"""``hypic eval cluster``: N replicas behind the document-aware router against one server, on a
multi-tenant RAG workload whose documents outgrow one replica's public pool.

The workload (``--workload tenants``): T tenants with D documents each; a request is a shared system
line, k of one tenant's documents in a fresh order, and a question (with ``--tenant-namespaces``, in a
cache namespace of its tenant's); ``--churn`` p: a request names a document new to its tenant with
probability p. ``--workload shared``: one knowledge base every user asks (``--corpus-docs`` documents,
each request ``--docs-per-request`` of them drawn by Zipf's law, exponent ``--doc-zipf``, in random
order); its warm-up is ``--warm-requests`` (default 32: covering a Zipf corpus would take thousands).
Poisson arrivals. Its working set (every
document's public-pool entry) is measured first on a ``hypic serve`` started for that (every document
warmed, ``/get_server_info``'s public-pool bytes read), and one replica's public pool is sized to
hold ``1 / --pool-ratio`` of it (or is ``--public-pool-size``): the working set must be larger than
one pool and smaller than ``--dp-size`` pools together.

Configurations, each its own server started here, one at a time, every replica on ``--threads``
torch threads: ``single`` (one plain ``hypic serve`` with one replica's pools), ``dpN-P`` for each
``--policies`` P (``hypic serve --dp-size N --router-policy P``, the same pools per replica),
``pooled`` (one plain server whose pools are N replicas' together: the hit-rate reference), and,
untimed, ``dpM-cache_aware`` with ``--hit-dp-size M`` replicas at ``--hit-qps`` (more replicas than
cores cannot be timed fairly: its TTFTs are recorded, not compared).

Each QPS level starts from flushed pools, sends ``--warm-requests`` requests of a separate slice of
the stream one by one (untimed; by default as many as name every document between them, so that a
level times a warm service: a document's first use is a miss under every policy), then replays
``--requests`` at their arrival times, concurrently
(``load``'s machinery). TTFT is the client's (from sending the request to its first token); the
server's (from the arrival at its ingress, builds on other replicas included) is kept beside it.
Records go to ``OUT/cluster.jsonl`` as each level ends (a rerun replays only missing levels);
``OUT/cluster_summary.json`` and ``.md`` give per configuration and level the segment hit rate
(hit / (hit + missed)), the token hit rate (cached / prompt tokens), TTFT p50/p90, the QPS at the
p50-TTFT SLO, and the targets, each as measured ratio against its goal.
"""
import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hypic.cluster.routing import POLICIES as ROUTER_POLICIES

from .data import DataError
from .load import capacities, level_done, sample_id, summarize_load, warm_and_replay
from .results import ResultLog
from .targets import ServerTarget
from .tenants import TenantConfig, TenantWorkload, shared_corpus
from .trace import TraceError

DATASET = "tenant-rag"
POLICIES = ("cache_aware", "round_robin", "power_of_two", "prefix")  # the study's default; --policies takes any
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "neon", "sve")
MEASURE_POOL = 4 << 30
RAY_WAIT = "RAY_raylet_start_wait_time_s"  # the working set's measuring server holds every document


@dataclass(frozen=True)
class Config:
    """One server to load: its replicas, their routing policy, its pools (as a multiple of one
    replica's) and whether its TTFTs are compared."""

    label: str
    dp_size: int = 1
    policy: str | None = None
    pool_scale: int = 1
    timed: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster study's options."""
    parser.add_argument("--dp-size", type=int, default=2, help="replicas of the timed dpN configurations")
    parser.add_argument("--policies", nargs="*", default=list(POLICIES), choices=ROUTER_POLICIES,
                        help="--router-policy of each timed dpN configuration (none: no replicated one)")
    parser.add_argument("--no-single", dest="single", action="store_false", help="leave out `single`")
    parser.add_argument("--no-pooled", dest="pooled", action="store_false", help="leave out `pooled`")
    parser.add_argument("--hit-dp-size", type=int, default=4,
                        help="replicas of the untimed hit-rate configuration (0: none)")
    parser.add_argument("--hit-qps", type=float, default=0.5, help="the untimed configuration's one QPS level")
    parser.add_argument("--workload", choices=("tenants", "shared"), default="tenants",
                        help="tenants: each tenant its own documents; shared: one corpus every user asks, "
                             "documents drawn by Zipf popularity")
    parser.add_argument("--corpus-docs", type=int, default=400, help="--workload shared: documents in the corpus")
    parser.add_argument("--doc-zipf", type=float, default=1.0, help="--workload shared: Zipf exponent of documents")
    parser.add_argument("--churn", type=float, default=0.0,
                        help="share of requests that name a document new to their tenant (a growing knowledge base)")
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--docs-per-tenant", type=int, default=6)
    parser.add_argument("--docs-per-request", type=int, default=3)
    parser.add_argument("--doc-words", type=int, default=160, help="words of every document (after its header)")
    parser.add_argument("--tenant-zipf", type=float, default=0.0, help="Zipf exponent of tenant popularity (0: uniform)")
    parser.add_argument("--tenant-namespaces", action="store_true",
                        help="each tenant's requests name a cache_salt of their own (tenants isolated, as "
                             "multi-tenant services run them); default: every request in the shared namespace")
    parser.add_argument("--pool-ratio", type=float, default=1.5,
                        help="working set / one replica's public pool (between 1 and --dp-size)")
    parser.add_argument("--public-pool-size", default=None,
                        help="one replica's public pool (e.g. 48M) instead of sizing it by --pool-ratio")
    parser.add_argument("--private-pool-size", default="64M", help="one replica's private pool")
    parser.add_argument("--model", default="default", help="checkpoint directory, or default (the shipped model)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server or replica")
    parser.add_argument("--max-running", type=int, default=64, help="--max-running-requests of each server or replica")
    parser.add_argument("--qps", type=float, nargs="+", default=[0.5, 1, 2, 4], help="QPS levels of the timed ones")
    parser.add_argument("--requests", type=int, default=24, help="requests replayed per QPS level")
    parser.add_argument("--warm-requests", type=int, default=None,
                        help="untimed requests before each level (default: the fewest of the warm-up slice that name "
                             "every document between them, at most two per document, so a level measures a warm "
                             "service rather than first uses of documents)")
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--slo", type=float, default=1.0, help="p50 TTFT (s) that defines a configuration's capacity")
    parser.add_argument("--stop-ttft", type=float, default=3.0, help="stop a ladder at this p50 TTFT (s)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a started server has to become healthy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("eval/runs"), help="folder of the JSONL and summaries")
    parser.add_argument("--no-progress", action="store_true")


def _check(args: argparse.Namespace) -> None:
    if any(q <= 0 for q in args.qps) or args.hit_qps <= 0:
        raise DataError("--qps levels and --hit-qps must be > 0")
    if args.requests < 1 or (args.warm_requests or 0) < 0 or args.output_tokens < 1 or args.threads < 1:
        raise DataError("--requests, --output-tokens and --threads must be >= 1, --warm-requests >= 0")
    if args.dp_size < 2 or args.hit_dp_size < 0 or args.hit_dp_size == 1:
        raise DataError("--dp-size must be >= 2, --hit-dp-size 0 (none) or >= 2")
    if args.slo <= 0 or args.stop_ttft <= 0:
        raise DataError("--slo and --stop-ttft must be > 0")
    if args.public_pool_size is None and not 1 < args.pool_ratio < args.dp_size:
        raise DataError(f"--pool-ratio must be between 1 and --dp-size ({args.dp_size}): the working set must "
                        "outgrow one replica's pool and fit in all of them")


def configurations(args: argparse.Namespace) -> list[Config]:
    """The servers to load, in order."""
    n = args.dp_size
    configs = [Config("single")] if args.single else []
    configs += [Config(f"dp{n}-{policy}", n, policy) for policy in dict.fromkeys(args.policies)]
    configs += [Config("pooled", pool_scale=n)] if args.pooled else []
    if args.hit_dp_size:
        configs.append(Config(f"dp{args.hit_dp_size}-cache_aware", args.hit_dp_size, "cache_aware", timed=False))
    return configs


def warm_requests_covering(workload: TenantWorkload) -> int:
    """The default warm-up: the warm-up slice's requests up to the one that has named every document,
    at most two per document (a rare tenant's last document is left to the timed phase)."""
    return workload.covering_count(2 * len(workload.all_documents()))


def _size(text: str, option: str) -> int:
    from hypic.cli import parse_size
    try:
        size = parse_size(text)
    except argparse.ArgumentTypeError as err:
        raise DataError(f"{option}: {err}") from None
    if size is None or size < 1:
        raise DataError(f"{option} must be a size in bytes, e.g. 48M")
    return size


@contextlib.contextmanager
def _patient_ray() -> Iterator[None]:
    """Ray's node start given more time than its default (a loaded machine misses it) while a
    server starts; the environment as it was after."""
    before = os.environ.get(RAY_WAIT)
    os.environ[RAY_WAIT] = before or "120"
    try:
        yield
    finally:
        if before is None:
            del os.environ[RAY_WAIT]


def _start(options: list[str], args: argparse.Namespace, log: Path) -> Any:
    """``hypic serve OPTIONS``, tried twice: a replicated one's Ray start can fail on a loaded machine."""
    from hypic.server.launch import start_server
    for attempt in range(2):
        try:
            with _patient_ray():
                return start_server(options, log, threads=args.threads, timeout_s=args.start_timeout)
        except RuntimeError as err:
            if attempt:
                raise DataError(f"could not start `hypic serve {' '.join(options)}`: {err}") from None
            print(f"hypic eval cluster: the server did not start, trying again: {str(err)[-300:]}", file=sys.stderr)


@contextlib.contextmanager
def serving(options: list[str], args: argparse.Namespace, log: Path) -> Iterator[ServerTarget]:
    """A ``hypic serve OPTIONS`` started here, stopped after whatever happens."""
    options = [*options, "--mode", "hypic", "--log-level", "warning", "--dtype", args.dtype]
    options += [] if args.model == "default" else ["--model", str(args.model)]
    server = _start(options, args, log)
    try:
        yield ServerTarget(server.url)
    finally:
        server.stop()


def server_options(config: Config, args: argparse.Namespace, pool_bytes: int) -> list[str]:
    """``hypic serve`` options of ``config``: its pools, and its replicas and their routing."""
    scale = config.pool_scale
    options = ["--public-pool-size", str(pool_bytes * scale),
               "--private-pool-size", str(_size(args.private_pool_size, "--private-pool-size") * scale),
               "--max-running-requests", str(args.max_running)]
    replicas = ["--dp-size", str(config.dp_size), "--router-policy", config.policy,
                "--allow-cpu-oversubscription"]  # the untimed hit-rate configuration has more replicas than cores
    return options + (replicas if config.dp_size > 1 else [])


def measure_working_set(workload: TenantWorkload, args: argparse.Namespace, logs: Path) -> dict[str, int]:
    """Every document warmed on a server that holds them all: the public pool's bytes and entries."""
    documents = workload.all_documents()
    with serving(["--public-pool-size", str(MEASURE_POOL)], args, logs / "server-measure.log") as target:
        for start in range(0, len(documents), 64):
            target.warmup(documents[start:start + 64])
        pool = _settled_pool(target, len(documents))
    if pool["entries"] != len(documents):
        raise DataError(f"{len(documents)} documents warmed, {pool['entries']} cached: documents of --doc-words "
                        f"{args.doc_words} must be longer than the seams")
    return {"bytes": int(pool["bytes"]), "entries": int(pool["entries"])}


def _settled_pool(target: ServerTarget, entries: int, deadline_s: float = 10.0) -> dict[str, Any]:
    """The public pool as ``/get_server_info`` reports it once it counts ``entries`` (its counters are
    published by the engine loop a moment after a warm-up answers), or at the deadline."""
    end = time.monotonic() + deadline_s
    pool = target.info()["public_pool"]
    while pool["entries"] < entries and time.monotonic() < end:
        time.sleep(0.2)
        pool = target.info()["public_pool"]
    return pool


def pool_size(working_set: dict[str, int], args: argparse.Namespace) -> int:
    """One replica's public pool: ``--public-pool-size``, or the working set / ``--pool-ratio``;
    refused unless the working set outgrows it and fits in ``--dp-size`` of them."""
    if args.public_pool_size is not None:
        pool = _size(args.public_pool_size, "--public-pool-size")
    else:
        pool = int(working_set["bytes"] / args.pool_ratio)
    if not pool < working_set["bytes"] < args.dp_size * pool:
        raise DataError(f"the working set ({working_set['bytes']:,} bytes) must be larger than one replica's public "
                        f"pool ({pool:,}) and smaller than {args.dp_size} of them")
    return pool


def _record(config: Config, qps: float, index: int, request: Any, outcome: dict[str, Any], wall: float) -> dict:
    """One request's record; ``ttft_s`` (what the policies are ranked by) is the client's, the server's
    ``meta_info`` TTFT kept beside it as ``server_ttft_s``."""
    return {"dataset": DATASET, "sample": sample_id(qps, index), "method": config.label, "dp_size": config.dp_size,
            "policy": config.policy, "timed": config.timed, "qps": qps, "request": index, "tenant": request.tenant,
            "documents": list(request.documents), "level_wall_s": wall, **outcome}


def run_level(target: ServerTarget, config: Config, workload: TenantWorkload, qps: float, args: argparse.Namespace,
              results: ResultLog) -> list[dict[str, Any]]:
    """Flush, warm, replay one QPS level of ``config``; its records, appended to ``results``."""
    warm = workload.requests(args.warm_requests, 0, target.separator)
    requests = workload.requests(args.requests, 1, target.separator)
    outcomes, wall = warm_and_replay(target, [r.prompt for r in warm], [r.prompt for r in requests],
                                     workload.arrivals(args.requests, qps), args.output_tokens,
                                     [r.salt for r in warm], [r.salt for r in requests])
    records = [_record(config, qps, i, request, outcome, wall)
               for i, (request, outcome) in enumerate(zip(requests, outcomes))]
    for record in records:
        results.add(record)
    return records


def _levels(config: Config, args: argparse.Namespace) -> list[float]:
    return sorted(args.qps) if config.timed else [args.hit_qps]


def run_config(config: Config, workload: TenantWorkload, pool_bytes: int, args: argparse.Namespace,
               results: ResultLog, logs: Path, progress: Any) -> list[dict[str, Any]]:
    """Every level of ``config``'s ladder, up to the first whose p50 TTFT reaches ``--stop-ttft``; a
    server is started only if a level is missing from ``results``."""
    records: list[dict[str, Any]] = []
    target: ServerTarget | None = None
    with contextlib.ExitStack() as stack:
        for qps in _levels(config, args):
            if level_done(results, DATASET, config.label, qps, args.requests):
                level = [results.get((DATASET, sample_id(qps, i), config.label)) for i in range(args.requests)]
            else:
                target = target or stack.enter_context(
                    serving(server_options(config, args, pool_bytes), args, logs / f"server-{config.label}.log"))
                level = run_level(target, config, workload, qps, args, results)
            records += level
            progress.update()
            if _p50(level) >= args.stop_ttft:
                break
    return records


def _p50(records: Sequence[dict[str, Any]]) -> float:
    return summarize_load(records)[0]["ttft_p50_s"]


def segment_hit_rate(records: Sequence[dict[str, Any]]) -> float:
    """Segments hit / (hit + missed) over the answered ``records``."""
    done = [r for r in records if r["ok"]]
    hit = sum(r.get("segments_hit", 0) for r in done)
    return hit / max(hit + sum(r.get("segments_missed", 0) for r in done), 1)


def per_replica(records: Sequence[dict[str, Any]]) -> list[int]:
    """How many of the answered ``records`` each replica served, most first (empty for a plain server)."""
    served = Counter(r["replica"] for r in records if r["ok"] and "replica" in r)
    return sorted(served.values(), reverse=True)


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``load``'s rows per configuration and QPS (TTFT: the client's), with the segment hit rate; in
    the records' order of configurations, then by QPS."""
    rows = summarize_load(records)
    for row in rows:
        mine = [r for r in records if r["method"] == row["method"] and r["qps"] == row["qps"]]
        row.update(segment_hit_rate=segment_hit_rate(mine), timed=mine[0]["timed"], dp_size=mine[0]["dp_size"],
                   per_replica=per_replica(mine))
    order = list(dict.fromkeys(r["method"] for r in records))
    return sorted(rows, key=lambda r: (order.index(r["method"]), r["qps"]))


@dataclass(frozen=True)
class Goal:
    """A target: ``numerator``'s measure over ``denominator``'s must be at least ``at_least``."""

    measure: str  # "segment hit rate" or "QPS at SLO"
    numerator: str
    denominator: str
    at_least: float


def goals(args: argparse.Namespace) -> list[Goal]:
    """The targets: the cache-aware replicas' hit rate near one pool as large as all of theirs, and
    their capacity against one server and the cache-blind policies."""
    ours = f"dp{args.dp_size}-cache_aware"
    return [Goal("segment hit rate", ours, "pooled", 0.9), Goal("QPS at SLO", ours, "single", 1.7),
            Goal("QPS at SLO", ours, f"dp{args.dp_size}-round_robin", 2.0),
            Goal("QPS at SLO", ours, f"dp{args.dp_size}-prefix", 2.0)]


def _common_hit_rates(records: Sequence[dict[str, Any]], goal: Goal) -> tuple[float, float] | None:
    """Both configurations' segment hit rates over the QPS levels both ran (None if there are none)."""
    levels = [{r["qps"] for r in records if r["method"] == name} for name in (goal.numerator, goal.denominator)]
    common = levels[0] & levels[1]
    if not common:
        return None
    mine, theirs = ([r for r in records if r["method"] == name and r["qps"] in common]
                    for name in (goal.numerator, goal.denominator))
    return segment_hit_rate(mine), segment_hit_rate(theirs)


def judge(goal: Goal, records: Sequence[dict[str, Any]], capacity: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The goal's measured ratio, whether it is exact or a bound, and PASS, MISS or UNKNOWN."""
    found = {**asdict(goal), "ratio": None, "bound": "=", "verdict": "UNKNOWN"}
    if goal.measure == "segment hit rate":
        rates = _common_hit_rates(records, goal)
        if rates is None or rates[1] == 0:
            return found
        found["ratio"] = rates[0] / rates[1]
    else:
        mine, theirs = capacity.get(goal.numerator), capacity.get(goal.denominator)
        if not mine or not theirs or mine["qps"] is None or theirs["qps"] is None:
            return found
        found["ratio"] = mine["qps"] / theirs["qps"]
        found["bound"] = {(True, False): ">=", (False, True): "<="}.get((mine["lower_bound"], theirs["lower_bound"]),
                                                                          "=" if not mine["lower_bound"] else "?")
    passed = found["ratio"] >= goal.at_least
    if found["bound"] == "=" or (found["bound"] == ">=" and passed) or (found["bound"] == "<=" and not passed):
        found["verdict"] = "PASS" if passed else "MISS"
    return found


def machine() -> dict[str, Any]:
    """The CPU's model name, its instruction-set extensions of note, and its core count."""
    name, flags = "unknown", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown":
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    return {"cpu": name, "isa": [f for f in ISA_FLAGS if f in flags], "cores": os.cpu_count()}


def _percent(value: float) -> str:
    return f"{value:.1%}"


def _ratio_text(goal: dict[str, Any]) -> str:
    if goal["ratio"] is None:
        return "unknown (a configuration is missing or never met the SLO)"
    if goal["bound"] == "?":
        return f"unknown (both only lower bounds: {goal['ratio']:.2f}x of theirs)"
    return f"{'' if goal['bound'] == '=' else goal['bound'] + ' '}{goal['ratio']:.2f}x"


def format_cluster(summary: dict[str, Any]) -> str:
    """The summary as markdown: per configuration and level, then capacities and targets."""
    lines = ["| configuration | QPS | requests | failed | per replica | segment hit rate | token hit rate | "
             "TTFT p50 (s) | TTFT p90 (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        label = r["method"] if r["timed"] else f"{r['method']} (untimed)"
        lines.append(f"| {label} | {r['qps']:g} | {r['requests']} | {r['failed']} | "
                     f"{' / '.join(map(str, r['per_replica'])) or '-'} | "
                     f"{_percent(r['segment_hit_rate'])} | {_percent(r['hit_rate'])} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} |")
    lines.append("")
    for name, found in summary["capacity_qps"].items():
        qps = ("below the first level" if found["qps"] is None else
               f">= {found['qps']:.2f} (the SLO was not reached)" if found["lower_bound"] else f"{found['qps']:.2f}")
        lines.append(f"- {name}: QPS at p50 TTFT {summary['slo_s']:g} s = {qps}")
    for goal in summary["targets"]:
        ratio = _ratio_text(goal)
        lines.append(f"- target: {goal['measure']} {goal['numerator']} / {goal['denominator']} = {ratio} "
                     f"(target >= {goal['at_least']:g}x): {goal['verdict']}")
    return "\n".join(lines)


def _header(summary: dict[str, Any]) -> str:
    m, w, runs = summary["machine"], summary["working_set"], summary["runs"]
    return "\n".join([
        f"Machine: {m['cpu']}, {m['cores']} cores, ISA {' '.join(m['isa']) or 'none of note'}; every server or "
        f"replica on {summary['threads']} torch thread(s).",
        f"Working set: {w['entries']} documents, {w['bytes']:,} bytes of public-pool entries; one replica's public "
        f"pool {summary['public_pool_bytes']:,} bytes ({w['bytes'] / summary['public_pool_bytes']:.2f}x smaller).",
        f"Runs: {runs['configurations']} configurations, {runs['levels']} levels, {runs['requests']} timed-phase "
        f"requests ({runs['per_level']} per level, after {runs['warm_per_level']} untimed warm-up requests each).", ""])


SHARED_WARM_REQUESTS = 32  # a shared corpus's warm-up: its Zipf tail would take thousands of requests to cover


def workload_of(args: argparse.Namespace) -> TenantWorkload:
    """The workload ``args`` ask for (``DataError`` naming what is wrong)."""
    try:
        if args.workload == "shared":
            return TenantWorkload(shared_corpus(args.corpus_docs, args.docs_per_request, args.doc_zipf, args.doc_words,
                                                args.seed, args.churn))
        return TenantWorkload(TenantConfig(args.tenants, args.docs_per_tenant, args.docs_per_request, args.doc_words,
                                           args.tenant_zipf, args.seed, args.tenant_namespaces, churn=args.churn))
    except TraceError as err:
        raise DataError(str(err)) from None


def run_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """The cluster study of ``args``: records, summary, and where they were written."""
    from tqdm import tqdm
    _check(args)
    workload = workload_of(args)
    if args.warm_requests is None:
        args.warm_requests = warm_requests_covering(workload) if args.workload == "tenants" else SHARED_WARM_REQUESTS
    configs = configurations(args)
    results = ResultLog(args.out / "cluster.jsonl")
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        logs = Path(folder)
        working_set = measure_working_set(workload, args, logs)
        pool = pool_size(working_set, args)
        shape = workload.config
        print(f"hypic eval cluster: {shape.tenants} tenants x {shape.docs_per_tenant} documents of {args.doc_words} "
              f"words, working set {working_set['bytes']:,} bytes; one replica's public pool {pool:,} bytes; "
              f"configurations {', '.join(c.label for c in configs)}; {len(results.records)} records already in "
              f"{results.path}", file=sys.stderr)
        with tqdm(total=sum(len(_levels(c, args)) for c in configs), desc="cluster", unit="level",
                  disable=args.no_progress, file=sys.stderr) as progress:
            for config in configs:
                records += run_config(config, workload, pool, args, results, logs, progress)
    return _report(records, configs, workload, working_set, pool, args)


def _report(records: list[dict[str, Any]], configs: list[Config], workload: TenantWorkload,
            working_set: dict[str, int], pool: int, args: argparse.Namespace) -> dict[str, Any]:
    rows = summarize(records)
    capacity = capacities([r for r in rows if r["timed"]], args.slo)
    summary = {"study": "cluster", "workload": asdict(workload.config), "configurations": [asdict(c) for c in configs],
               "working_set": working_set, "public_pool_bytes": pool, "private_pool_size": args.private_pool_size,
               "threads": args.threads, "dtype": args.dtype, "slo_s": args.slo, "machine": machine(),
               "runs": {"configurations": len(configs), "levels": len(rows), "requests": len(records),
                        "per_level": args.requests, "warm_per_level": args.warm_requests},
               "rows": rows, "capacity_qps": capacity}
    summary["targets"] = [judge(goal, records, capacity) for goal in goals(args)]
    (args.out / "cluster_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = _header(summary) + "\n" + format_cluster(summary)
    (args.out / "cluster_summary.md").write_text(table + "\n")
    print(table)
    return {"records": records, "summary": summary, "path": args.out / "cluster_summary.json"}
