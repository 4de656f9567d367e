"""Early refusal under overload: ``hypic serve --dp-size 2`` with and without ``--ttft-slo`` (and
``--tbt-slo``), driven past what it can serve within the SLO.

The workload is ``hypic eval cluster --workload shared``'s: one corpus every user asks (Zipf
popularity), 5 documents a request in random order, Poisson arrivals at ``--qps`` (about twice
the QPS the service holds at a 1 s p50 TTFT on this kind of box). Each round starts both servers in
turn (the order alternates between rounds), each from flushed pools warmed by the same untimed
requests, then replays the same timed requests as ``hypic eval load`` does (``load.replay``): per
request its first token's TTFT, or the HTTP status of a refusal and the seconds until it came. Per
server and round: the answers within the SLO per second of arrivals (the goodput), the refused
share and the slowest refusal.

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

from hypic.evaluation.cluster import machine
from hypic.evaluation.load import replay
from hypic.evaluation.targets import ServerTarget
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


def run_server(options: list[str], workload: TenantWorkload, args: argparse.Namespace, log: Path) -> list[dict[str, Any]]:
    server = start_server(["--dp-size", "2", "--mode", "hypic", "--log-level", "warning", *options], log,
                          threads=1, timeout_s=300)
    try:
        target = ServerTarget(server.url)
        target.flush()
        for request in workload.requests(args.warm_requests, 0):
            target.generate(request.prompt, 1)
        time.sleep(2.5)  # the replicas' rates reach the ingress with their status, once a second
        timed = workload.requests(args.requests, 1)
        outcomes, _ = asyncio.run(replay(server.url, [r.prompt for r in timed],
                                         workload.arrivals(args.requests, args.qps), args.output_tokens))
        return outcomes
    finally:
        server.stop()


def summary(outcomes: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    span = args.requests / args.qps
    answered = [o for o in outcomes if o["ok"]]
    refused = [o for o in outcomes if o.get("status") == 503]
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
