"""Early refusal under overload: ``hypic serve --dp-size 2`` with and without ``--ttft-slo`` (and
``--tbt-slo``), driven past what it can serve within the SLO.

The workload is ``hypic eval cluster --workload shared``'s: one corpus every user asks (Zipf
popularity), 5 documents a request in random order, Poisson arrivals at ``--qps`` (about twice
the QPS the service holds at a 1 s p50 TTFT on this kind of box). Each round starts both servers in
turn (the order alternates between rounds), each from flushed pools warmed by the same untimed
requests, then replays the same timed requests. Per request the client records the HTTP status,
the seconds to the answer's first byte (a refusal's 503) and, for an answer, its first token's
TTFT. Per server and round: the answers within the SLO per second of arrivals (the goodput), the
refused share and the slowest refusal.

    python eval/bench_early_refusal.py --rounds 2 --json eval/results/early_refusal/run1.json
"""
import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from hypic.evaluation.cluster import machine
from hypic.evaluation.tenants import TenantWorkload, shared_corpus
from hypic.server.launch import start_server


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qps", type=float, default=24.0)
    parser.add_argument("--requests", type=int, default=192, help="timed requests a round")
    parser.add_argument("--warm-requests", type=int, default=48)
    parser.add_argument("--slo", type=float, default=1.0, help="--ttft-slo of the refusing server (s)")
    parser.add_argument("--tbt-slo", type=float, default=None, help="also --tbt-slo on the refusing server")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--corpus-docs", type=int, default=100)
    parser.add_argument("--json", type=Path, required=True)
    return parser.parse_args()


async def one_request(client: httpx.AsyncClient, prompt: str, delay: float, tokens: int) -> dict[str, Any]:
    await asyncio.sleep(delay)
    body = {"text": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    start, first = time.perf_counter(), None
    try:
        async with client.stream("POST", "/generate", json=body) as response:
            answered = time.perf_counter() - start
            if response.status_code != 200:
                await response.aread()
                return {"status": response.status_code, "answered_s": answered}
            error = None
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - start
                    error = json.loads(line[len("data: "):]).get("error")
    except httpx.HTTPError as err:
        return {"status": 0, "error": f"{type(err).__name__}: {err}"}
    if error is not None:  # a server that refuses inside its stream: counted as refused, not answered
        return {"status": 503 if "busy" in str(error) or "--ttft-slo" in str(error) else 500, "answered_s": first,
                "in_stream": True}
    return {"status": 200, "answered_s": answered, "ttft_s": first, "latency_s": time.perf_counter() - start}


async def replay(url: str, prompts: list[str], arrivals: list[float], tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=1000)) as client:
        return list(await asyncio.gather(*(one_request(client, p, a, tokens) for p, a in zip(prompts, arrivals))))


def run_server(options: list[str], workload: TenantWorkload, args: argparse.Namespace, log: Path) -> list[dict[str, Any]]:
    server = start_server(["--dp-size", "2", "--mode", "hypic", "--log-level", "warning", *options], log,
                          threads=1, timeout_s=300)
    try:
        client = httpx.Client(base_url=server.url, timeout=600)
        client.post("/flush_cache").raise_for_status()
        for request in workload.requests(args.warm_requests, 0):
            client.post("/generate", json={"text": request.prompt, "sampling_params": {"max_new_tokens": 1}}).raise_for_status()
        time.sleep(2.5)  # the replicas' rates reach the ingress with their status, once a second
        timed = workload.requests(args.requests, 1)
        return asyncio.run(replay(server.url, [r.prompt for r in timed], workload.arrivals(args.requests, args.qps),
                                  args.output_tokens))
    finally:
        server.stop()


def summary(outcomes: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    span = args.requests / args.qps
    answered = [o for o in outcomes if o["status"] == 200 and o.get("ttft_s") is not None]
    refused = [o for o in outcomes if o["status"] == 503]
    within = [o for o in answered if o["ttft_s"] <= args.slo]
    return {"goodput_per_s": len(within) / span, "answered": len(answered), "within_slo": len(within),
            "refused": len(refused), "failed": len(outcomes) - len(answered) - len(refused),
            "ttft_p50_s": statistics.median(o["ttft_s"] for o in answered) if answered else None,
            "refusal_max_s": max((o["answered_s"] for o in refused), default=None),
            "refusal_p50_s": statistics.median(o["answered_s"] for o in refused) if refused else None}


def main() -> None:
    args = parse()
    workload = TenantWorkload(shared_corpus(args.corpus_docs, 5, 1.0, 160))
    refusing = ["--ttft-slo", str(args.slo), *(["--tbt-slo", str(args.tbt_slo)] if args.tbt_slo else [])]
    servers = {"plain": [], "refusing": refusing}
    rounds = []
    logs = Path(tempfile.mkdtemp(prefix="hypic-refusal-"))
    for round_index in range(args.rounds):
        order = list(servers) if round_index % 2 == 0 else list(reversed(servers))
        for name in order:
            outcomes = run_server(servers[name], workload, args, logs / f"{name}-{round_index}.log")
            result = {"round": round_index, "server": name, **summary(outcomes, args), "outcomes": outcomes}
            rounds.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "outcomes"}), flush=True)
    goodput = {name: statistics.median(r["goodput_per_s"] for r in rounds if r["server"] == name) for name in servers}
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(), "rounds": rounds,
              "median_goodput_per_s": goodput, "goodput_ratio": goodput["refusing"] / max(goodput["plain"], 1e-9)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"goodput (answers within {args.slo:g} s per second of arrivals), median of {args.rounds} rounds: "
          f"plain {goodput['plain']:.2f}, refusing {goodput['refusing']:.2f} ({report['goodput_ratio']:.2f}x)")


if __name__ == "__main__":
    main()
