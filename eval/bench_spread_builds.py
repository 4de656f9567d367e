"""Cold documents built on two replicas at once: the time to first token of a request that names two
fresh documents of about ``--doc-tokens`` tokens each, on ``hypic serve --dp-size 2`` (one thread a
replica; ``cache_aware`` builds one of the two on the other replica) and on one instance with one
thread and with two (the machine's two cores, as the two replicas have between them).

Each configuration is one server of this tree or, with ``--baseline REV``, of that commit too (a git
worktree; its servers run from it); each runs an untimed warm-up request, then ``--runs`` requests
one after another, each of two documents no earlier request named (so every request builds both).
A request asks for one greedy token, not streamed: the client's time from sending it to its answer
is its TTFT plus one decode step. Recorded per request: that client time, the server's
``meta_info.ttft`` and ``e2e_latency``, the replica and the documents built on another one.

    python eval/bench_spread_builds.py [--runs 5] [--doc-tokens 2500] [--baseline REV] [--json OUT]
"""
import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from worktrees import checkout, remove

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"one-1t": ([], 1), "one-2t": ([], 2), "dp2": (["--dp-size", "2"], 1)}  # options, threads (a replica's)


def _documents(tokenizer: Any, count: int, tokens: int, seed: int) -> list[str]:
    from hypic.evaluation.scaling import make_document
    rng = random.Random(seed)
    return [make_document(tokenizer, tokens, rng) for _ in range(count)]


def _request(server: Any, documents: list[str]) -> dict[str, Any]:
    from hypic.evaluation.scaling import build_prompt
    body = {"text": build_prompt(documents), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    start = time.perf_counter()
    answer = server.post("/generate", body)
    client = time.perf_counter() - start
    meta = answer["meta_info"]
    return {"client_s": client, "server_ttft_s": meta["ttft"], "server_e2e_s": meta.get("e2e_latency"),
            "replica": meta.get("replica"), "built_remotely": meta.get("segments_built_remotely", 0),
            "segments_missed": meta["segments_missed"]}


def _serve(tree: Path, name: str, log: Path) -> Any:
    from hypic.server.launch import start_server
    args, threads = CONFIGS[name]
    # `hypic serve` under PYTHONPATH=TREE imports that tree's package (its Ray workers too: they import
    # the package the server imported)
    return start_server([*args, "--log-level", "warning"], log, threads=threads, timeout_s=600,
                        prefix=["env", f"PYTHONPATH={tree}"])


def measure(tree: Path, name: str, runs: int, doc_tokens: int, tokenizer: Any, seed: int) -> list[dict[str, Any]]:
    log = Path(tempfile.mkdtemp()) / f"{name}.log"
    server = _serve(tree, name, log)
    try:
        _request(server, _documents(tokenizer, 2, doc_tokens, seed))  # warm-up, not kept
        return [_request(server, _documents(tokenizer, 2, doc_tokens, seed + 1 + run)) for run in range(runs)]
    finally:
        server.stop()


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--doc-tokens", type=int, default=2500)
    parser.add_argument("--baseline", help="a commit to measure as well (dp2 only)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from hypic import Engine
    tokenizer = Engine.from_pretrained("default").tokenizer
    trees = {"after": ROOT} | ({"before": checkout(args.baseline)} if args.baseline else {})
    found: dict[str, list[dict[str, Any]]] = {}
    try:
        for label, tree in trees.items():
            for name in CONFIGS if label == "after" else ["dp2"]:
                rows = measure(tree, name, args.runs, args.doc_tokens, tokenizer, seed=1000 * len(found))
                found[f"{label}/{name}"] = rows
                print(f"{label}/{name}: client {_median(rows, 'client_s'):.3f} s, server ttft "
                      f"{_median(rows, 'server_ttft_s'):.3f} s (medians of {len(rows)}); built remotely "
                      f"{[r['built_remotely'] for r in rows]}", flush=True)
    finally:
        if args.baseline:
            remove(trees["before"])
    ratios = {f"{one} / {label}/dp2": _median(found[f"after/{one}"], "client_s") / _median(found[f"{label}/dp2"], "client_s")
              for one in ("one-1t", "one-2t") for label in trees}
    gaps = {key: statistics.median(r["client_s"] - r["server_ttft_s"] for r in rows) for key, rows in found.items()}
    for key, value in ratios.items():
        print(f"TTFT ratio (client) {key}: {value:.2f}x")
    for key, value in gaps.items():
        print(f"client - server TTFT, median, {key}: {value * 1000:.0f} ms")
    if args.json is not None:
        machine = {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version()}
        args.json.write_text(json.dumps({"machine": machine, "doc_tokens": args.doc_tokens, "runs": found,
                                         "ratios": ratios, "client_minus_server_s": gaps,
                                         "baseline": args.baseline}, indent=1))


if __name__ == "__main__":
    main()
