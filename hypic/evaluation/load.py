"""``hypic eval load``: TTFT p50 / p90 / p99 and token throughput against QPS (paper Fig. 11).

Each method is served by its own ``hypic serve --mode M --seam-width W`` process (started here,
one at a time, on the same model and machine, each on a free port or in turn on ``--port``), or by
the server at ``--url`` in the mode it was started with (another SGLang-compatible server counts as
prefix caching). Each QPS level starts from flushed pools, sends ``--warm-requests`` requests of a
separate slice of the trace one by one (the warm-up), then replays the level's ``--requests``
requests at their arrival times, all concurrently. TTFT is the client's (request sent to its first
token's chunk, streamed); the server's ``meta_info.ttft`` (from the arrival there, queueing included)
is recorded beside it.

A level's requests are appended to ``OUT/load.jsonl`` when the level ends: a rerun replays only
levels with missing requests (a server is started only for a method that has one). A method's
ladder stops after the first level whose p50 TTFT reaches ``--stop-ttft``. The summary gives, per
method, the QPS at which p50 TTFT first crosses the SLO (log-linear between the levels around it) and
HYPIC's ratio to prefix caching and full recompute there.
"""
import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from .data import DataError
from .methods import Method, parse_method
from .results import ResultLog
from .studies import plain_log_ticks, pyplot, save_figure
from .targets import ServerTarget, salted
from .trace import WORKLOADS, Trace, TraceConfig, TraceError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The load study's options."""
    parser.add_argument("--methods", nargs="+", default=["hypic:8", "prefix", "full"],
                        help="full, prefix, naive, hypic or hypic:W: one server each (ignored with --url)")
    parser.add_argument("--url", default=None, help="load the server at URL instead (its own mode only)")
    parser.add_argument("--port", type=int, default=None,
                        help="port of the servers started here, on 127.0.0.1: one at a time, so each method's "
                             "server listens on it in turn (to watch its /metrics, say); default: a free port "
                             "for each. Not with --url, which holds the port of the server to load")
    parser.add_argument("--model", default="default", help="checkpoint directory, or default (the shipped model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each started server (of each of its "
                        "ranks with --tp-size)")
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                        help="the started servers' --tp-size (tensor-parallel ranks)")
    parser.add_argument("--max-running", type=int, default=64, help="started servers' --max-running-requests")
    parser.add_argument("--qps", type=float, nargs="+", default=[0.5, 1, 2, 4, 8], help="QPS levels")
    parser.add_argument("--requests", type=int, default=40, help="requests replayed per QPS level")
    parser.add_argument("--warm-requests", type=int, default=20, help="untimed requests before each level")
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens generated per request")
    parser.add_argument("--slo", type=float, default=1.0, help="p50 TTFT (s) that defines a method's capacity")
    parser.add_argument("--stop-ttft", type=float, default=3.0, help="stop a method's ladder at this p50 TTFT (s)")
    parser.add_argument("--workload", choices=WORKLOADS, default="prod-rag",
                        help="prod-rag: PIC prompts over Zipf-popular documents; shared-prefix: plain prompts "
                             "sharing long system prompts")
    parser.add_argument("--documents", type=int, default=40, help="prod-rag: documents in the pool")
    parser.add_argument("--docs-per-request", type=int, default=4, help="prod-rag: documents per prompt")
    parser.add_argument("--mean-input-words", type=int, default=960, help="prod-rag: mean words of documents per prompt")
    parser.add_argument("--zipf", type=float, default=1.1, help="prod-rag: Zipf exponent of document popularity")
    parser.add_argument("--burstiness", type=float, default=2.0,
                        help="coefficient of variation of inter-arrival times (1: Poisson)")
    parser.add_argument("--groups", type=int, default=4, help="shared-prefix: system prompts")
    parser.add_argument("--system-words", type=int, default=300, help="shared-prefix: words per system prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("eval/runs"), help="folder of the JSONL, summary and figure")
    parser.add_argument("--no-progress", action="store_true")


def trace_config(args: argparse.Namespace) -> TraceConfig:
    return TraceConfig(args.workload, args.documents, args.docs_per_request, args.mean_input_words, args.zipf,
                       args.burstiness, args.groups, args.system_words, args.seed)


def _check(args: argparse.Namespace) -> None:
    if any(q <= 0 for q in args.qps) or args.requests < 1 or args.warm_requests < 0 or args.output_tokens < 1:
        raise DataError("--qps levels must be > 0, --requests and --output-tokens >= 1, --warm-requests >= 0")
    if args.slo <= 0 or args.stop_ttft <= 0:
        raise DataError("--slo and --stop-ttft must be > 0")
    if args.port is not None and args.url is not None:
        raise DataError("--port is the port of the servers `hypic eval load` starts; with --url nothing is "
                        "started and the port is the URL's (e.g. --url http://127.0.0.1:30000)")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise DataError("--port must be in 1..65535")


# meta_info fields a record keeps as they came (those a server sends): per-segment hits, the serving replica
PASSED_ON = ("segments_hit", "segments_missed", "segments_fetched", "prefix_hit_tokens", "replica")


def sample_id(qps: float, index: int) -> str:
    return f"qps={qps:g}/{index:05d}"


def level_done(results: ResultLog, workload: str, method: str, qps: float, count: int) -> bool:
    return all(results.get((workload, sample_id(qps, i), method)) for i in range(count))


async def _request(client: httpx.AsyncClient, prompt: str, delay: float, output_tokens: int,
                   cache_salt: str | None = None) -> dict[str, Any]:
    """One streamed /generate (in ``cache_salt``'s namespace, if given): the TTFT this client saw
    (request sent -> first token's chunk) and the one the server reports for it (from the request's
    arrival), the latency, the token counts."""
    await asyncio.sleep(delay)
    body = {"text": prompt, "stream": True, **salted(cache_salt),
            "sampling_params": {"max_new_tokens": output_tokens, "temperature": 0, "ignore_eos": True}}
    start, first, last = time.perf_counter(), None, None
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            if response.status_code != 200:  # a refusal's time is its answer's (a 503 as busy, at once)
                answered = time.perf_counter() - start
                return {"ok": False, "status": response.status_code, "answered_s": answered,
                        "error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    first, last = first or time.perf_counter(), json.loads(line[len("data: "):])
    except httpx.HTTPError as err:
        return {"ok": False, "error": f"{type(err).__name__}: {err}"}
    if first is None or last is None or "error" in last:
        return {"ok": False, "error": f"no token came back: {last}"}
    meta = last["meta_info"]
    return {"ok": True, "ttft_s": first - start, "ttft_source": "client", "server_ttft_s": meta.get("ttft"),
            "latency_s": time.perf_counter() - start, "prompt_tokens": int(meta["prompt_tokens"]),
            "completion_tokens": int(meta["completion_tokens"]), "cached_tokens": int(meta.get("cached_tokens", 0)),
            "output_ids": last.get("output_ids"), **{key: meta[key] for key in PASSED_ON if key in meta}}


async def replay(url: str, prompts: Sequence[str], arrivals: Sequence[float], output_tokens: int,
                 salts: Sequence[str | None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Send each prompt at its arrival time (with its cache salt from ``salts``, if given), all
    concurrently; (one outcome per prompt, wall seconds)."""
    salts = salts or [None] * len(prompts)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=1000)) as client:
        outcomes = await asyncio.gather(*(_request(client, p, a, output_tokens, salt)
                                          for p, a, salt in zip(prompts, arrivals, salts)))
    return list(outcomes), time.perf_counter() - start


def warm_and_replay(target: ServerTarget, warm_prompts: Sequence[str], prompts: Sequence[str],
                    arrivals: Sequence[float], output_tokens: int, warm_salts: Sequence[str | None] | None = None,
                    salts: Sequence[str | None] | None = None) -> tuple[list[dict[str, Any]], float]:
    """Flush the server's pools, send ``warm_prompts`` one by one (untimed), then ``replay`` the rest;
    each with its cache salt from ``warm_salts`` and ``salts``, if given."""
    target.flush()
    for prompt, salt in zip(warm_prompts, warm_salts or [None] * len(warm_prompts)):
        target.generate(prompt, 1, salt)
    return asyncio.run(replay(target.url, prompts, arrivals, output_tokens, salts))


def run_level(target: ServerTarget, method: Method, trace: Trace, qps: float, args: argparse.Namespace,
              results: ResultLog) -> list[dict[str, Any]]:
    """Flush, warm, replay one QPS level; its records, appended to ``results``."""
    outcomes, wall = warm_and_replay(target, trace.prompts(args.warm_requests, 0, target.separator),
                                     trace.prompts(args.requests, 1, target.separator),
                                     trace.arrivals(args.requests, qps), args.output_tokens)
    records = []
    for index, outcome in enumerate(outcomes):
        record = {"dataset": trace.config.workload, "sample": sample_id(qps, index), "method": method.label,
                  "mode": method.mode, "qps": qps, "request": index, "level_wall_s": wall, **outcome}
        results.add(record)
        records.append(record)
    return records


@contextlib.contextmanager
def serving(method: Method, args: argparse.Namespace, logs: Path) -> Iterator[ServerTarget]:
    """The server of ``method``: ``--url``'s, or a ``hypic serve`` started for it (on ``--port`` or a
    free port) and stopped after."""
    if args.url is not None:
        yield ServerTarget(args.url)
        return
    from hypic.server.launch import port_in_use, start_server
    if args.port is not None and port_in_use(args.port):  # else /health could be answered by whatever listens there
        raise DataError(f"port {args.port} is in use: pass another --port, or --url http://127.0.0.1:{args.port} to "
                        "load the server listening there")
    options = ["--mode", method.mode, "--seam-width", str(method.seam_width), "--log-level", "warning",
               "--max-running-requests", str(args.max_running), "--tp-size", str(args.tp_size)]
    options += [] if args.model == "default" else ["--model", str(args.model)]
    log = logs / f"server-{method.label.replace(':', '-')}.log"
    try:
        server = start_server(options, log, threads=args.threads, port=args.port)
    except RuntimeError as err:
        raise DataError(f"could not start `hypic serve` for {method.label}: {err}") from None
    try:
        yield ServerTarget(server.url)
    finally:
        server.stop()


def _p50(records: Sequence[dict[str, Any]]) -> float:
    ttfts = [r["ttft_s"] for r in records if r["ok"]]
    return float(np.percentile(ttfts, 50)) if ttfts else math.inf


def run_method(method: Method, trace: Trace, args: argparse.Namespace, results: ResultLog, logs: Path,
               progress: Any) -> list[dict[str, Any]]:
    """Every level of ``method``'s ladder, up to the first whose p50 TTFT reaches ``--stop-ttft``."""
    records: list[dict[str, Any]] = []
    target: ServerTarget | None = None
    with contextlib.ExitStack() as stack:
        for qps in sorted(args.qps):
            if level_done(results, trace.config.workload, method.label, qps, args.requests):
                level = [results.get((trace.config.workload, sample_id(qps, i), method.label))
                         for i in range(args.requests)]
            else:
                target = target or stack.enter_context(serving(method, args, logs))
                level = run_level(target, method, trace, qps, args, results)
            records += level
            progress.update()
            progress.set_postfix(method=method.label, qps=f"{qps:g}", p50=f"{_p50(level):.2f}s")
            if _p50(level) >= args.stop_ttft:
                break
    return records


def summarize_load(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and QPS: TTFT p50 / p90 / p99 (s), output and prompt tokens per second, hit rate."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["method"], record["qps"]), []).append(record)
    rows = []
    for (method, qps), group in groups.items():
        done = [r for r in group if r["ok"]]
        ttft = np.array([r["ttft_s"] for r in done] or [math.inf])
        wall = group[0]["level_wall_s"]
        prompt = sum(r["prompt_tokens"] for r in done)
        rows.append({"method": method, "qps": qps, "requests": len(group), "failed": len(group) - len(done),
                     "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p90_s": float(np.percentile(ttft, 90)),
                     "ttft_p99_s": float(np.percentile(ttft, 99)),
                     "output_tokens_per_s": sum(r["completion_tokens"] for r in done) / wall,
                     "prompt_tokens_per_s": prompt / wall,
                     "hit_rate": sum(r["cached_tokens"] for r in done) / max(prompt, 1),
                     "mean_prompt_tokens": prompt / max(len(done), 1),
                     "ttft_source": sorted({r["ttft_source"] for r in done})})
    return rows


def qps_at_slo(rows: Sequence[dict[str, Any]], slo: float) -> tuple[float | None, bool]:
    """(QPS where p50 TTFT first crosses ``slo``, log-linear between the levels around it; whether that
    is only a lower bound, the ladder never reaching the SLO). (None, False) if no level is below it.
    A level under the SLO above one over it (a noisy curve) does not raise the capacity."""
    above = [r for r in rows if r["ttft_p50_s"] >= slo]
    high = min(above, key=lambda r: r["qps"]) if above else None
    below = [r for r in rows if r["ttft_p50_s"] < slo and (high is None or r["qps"] < high["qps"])]
    if not below:
        return None, False
    low = max(below, key=lambda r: r["qps"])
    if high is None:
        return low["qps"], True
    if math.isinf(high["ttft_p50_s"]):  # every request of that level failed: no curve to interpolate
        return low["qps"], True
    frac = math.log(slo / low["ttft_p50_s"]) / math.log(high["ttft_p50_s"] / low["ttft_p50_s"])
    return math.exp(math.log(low["qps"]) + frac * math.log(high["qps"] / low["qps"])), False


def capacities(rows: Sequence[dict[str, Any]], slo: float) -> dict[str, dict[str, Any]]:
    """Per method: ``qps`` at the SLO and whether it is a ``lower_bound``."""
    methods = dict.fromkeys(r["method"] for r in rows)
    found = {m: qps_at_slo([r for r in rows if r["method"] == m], slo) for m in methods}
    return {m: {"qps": qps, "lower_bound": bound} for m, (qps, bound) in found.items()}


def capacity_ratios(capacity: dict[str, dict[str, Any]]) -> dict[str, str]:
    """HYPIC's capacity over each other method's, as text ('>= ' where HYPIC's is a lower bound);
    left out where the other's is unknown or only a lower bound."""
    ratios = {}
    for mine, ours in capacity.items():
        for other, theirs in capacity.items():
            if not mine.startswith("hypic") or other.startswith("hypic") or not ours["qps"]:
                continue
            if theirs["qps"] and not theirs["lower_bound"]:
                ratios[f"{mine} / {other}"] = f"{'>= ' if ours['lower_bound'] else ''}{ours['qps'] / theirs['qps']:.2f}x"
    return ratios


def format_load(rows: Sequence[dict[str, Any]], capacity: dict[str, dict[str, Any]], slo: float) -> str:
    """A Markdown table of the levels, then each method's capacity at the SLO and HYPIC's ratios."""
    lines = ["| method | QPS | requests | failed | TTFT p50 s | p90 s | p99 s | output tok/s | prompt tok/s | hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['qps']:g} | {r['requests']} | {r['failed']} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['prompt_tokens_per_s']:.0f} | {r['hit_rate']:.1%} |")
    lines.append("")
    for method, found in capacity.items():
        qps = ("below the first level" if found["qps"] is None else
               f">= {found['qps']:.2f} (the SLO was not reached)" if found["lower_bound"] else f"{found['qps']:.2f}")
        lines.append(f"- {method}: QPS at p50 TTFT {slo:g} s = {qps}")
    lines += [f"- {name}: {ratio}" for name, ratio in capacity_ratios(capacity).items()]
    return "\n".join(lines)


def draw_load(rows: Sequence[dict[str, Any]], slo: float) -> Any:
    """The figure of p50 TTFT against QPS (log-log, the SLO dashed) and token throughput against QPS."""
    plt = pyplot()
    figure, (ttft, throughput) = plt.subplots(1, 2, figsize=(9.5, 3.8))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["qps"])
        qps = [r["qps"] for r in mine]
        ttft.plot(qps, [r["ttft_p50_s"] for r in mine], marker="o", label=method)
        throughput.plot(qps, [r["prompt_tokens_per_s"] + r["output_tokens_per_s"] for r in mine], marker="o",
                        label=method)
    ttft.axhline(slo, linestyle="--", color="gray", label=f"SLO {slo:g} s")
    ttft.set(xscale="log", yscale="log", xlabel="QPS", ylabel="TTFT p50 (s)")
    throughput.set(xscale="log", xlabel="QPS", ylabel="token throughput (tokens/s)")
    for axis in (ttft.xaxis, ttft.yaxis, throughput.xaxis):
        plain_log_ticks(axis)
    ttft.legend(fontsize=8)
    return figure


def load_figure(rows: Sequence[dict[str, Any]], slo: float, path: Path) -> None:
    """``draw_load``'s figure, written to ``path``."""
    save_figure(draw_load(rows, slo), path)


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """The load study of ``args``: records, summary rows, capacities, and where they were written."""
    from tqdm import tqdm
    _check(args)
    try:
        trace = Trace(trace_config(args))
    except TraceError as err:
        raise DataError(str(err)) from None
    methods = [ServerTarget(args.url).method] if args.url else list(dict.fromkeys(parse_method(m) for m in args.methods))
    if any(method.state_cache_dtype != "float32" for method in methods):  # its servers store fp32 states
        raise DataError("hypic-bf16 runs in process only (hypic eval pareto, drift), not in the load study")
    results = ResultLog(args.out / "load.jsonl")
    print(f"hypic eval load: {args.workload} trace, {args.requests} requests per level at QPS "
          f"{', '.join(f'{q:g}' for q in sorted(args.qps))}, burstiness {args.burstiness:g}; methods "
          f"{', '.join(m.label for m in methods)}{'' if args.port is None else f' (servers on port {args.port})'}; "
          f"warm-up: pools flushed, then {args.warm_requests} requests "
          f"before each level; {len(results.records)} records already in {results.path}", file=sys.stderr)
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as logs, \
            tqdm(total=len(methods) * len(args.qps), desc="load", unit="level", disable=args.no_progress,
                 file=sys.stderr) as progress:
        for method in methods:
            records += run_method(method, trace, args, results, Path(logs), progress)
    rows = summarize_load(records)
    capacity = capacities(rows, args.slo)
    summary = args.out / "load_summary.json"
    summary.write_text(json.dumps({"study": "load", "trace": vars(trace.config), "slo_s": args.slo, "rows": rows,
                                   "capacity_qps": capacity, "ratios": capacity_ratios(capacity)}, indent=2) + "\n")
    load_figure(rows, args.slo, args.out / "load.png")
    print(format_load(rows, capacity, args.slo))
    return {"records": records, "rows": rows, "capacity": capacity, "summary": summary, "figure": args.out / "load.png"}
