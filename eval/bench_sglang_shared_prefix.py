"""SGLang's ``bench_serving`` on its generated-shared-prefix workload against ``hypic serve`` with one
thread and ``hypic serve --dp-size 2`` with one thread a replica: request throughput and the share
of prompt tokens served from cache, the two servers taking turns, one at a time.

The workload is bench_serving's own (``--dataset-name generated-shared-prefix``: ``--groups`` system
prompts of ``--system-tokens`` tokens, ``--per-group`` questions of 128 tokens each, ``--output-len``
tokens out with ``ignore_eos``, at most ``--concurrency`` requests in flight); each run draws new
system prompts (its own ``--seed``), so no run is served from an earlier one's cache. The cached share
is ``hypic_cached_tokens_total`` over ``hypic_prompt_tokens_total`` across the run (bench_serving's
one warm-up request included). The client is SGLang's, through ``eval/clients/sglang_bench_serving.py``
(its docstring says how to install it); ``--client-path`` is where it is installed. With ``--baseline
REV``, ``--dp-size 2`` of that commit (a git worktree, its servers run from it) takes its turn too.

    python eval/bench_sglang_shared_prefix.py --client-path ~/sglang-client [--runs 3] [--output-len 8]
        [--baseline REV] [--json OUT]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from worktrees import checkout, remove

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"one": [], "dp2": ["--dp-size", "2"], "dp2-before": ["--dp-size", "2"]}
COUNTERS = ("hypic_prompt_tokens_total", "hypic_cached_tokens_total")


def _counters(server: Any) -> dict[str, float]:
    status, text = server.request("GET", "/metrics")
    assert status == 200, text
    found = {name: float(value) for name, value in re.findall(r"^(hypic_\w+_total) ([0-9.e+]+)$", text, re.M)}
    return {name: found[name] for name in COUNTERS}


def _bench(server: Any, args: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    port = server.url.rsplit(":", 1)[1]
    command = [sys.executable, str(ROOT / "eval/clients/sglang_bench_serving.py"), "--backend", "sglang",
               "--port", port, "--tokenizer", str(ROOT / "hypic/assets/default_model"),
               "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
               "--gsp-prompts-per-group", str(args.per_group), "--gsp-system-prompt-len", str(args.system_tokens),
               "--gsp-output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
               "--num-prompts", str(args.groups * args.per_group), "--seed", str(seed),
               "--output-file", str(out), "--disable-tqdm"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.client_path, os.environ.get("PYTHONPATH")]))}
    before = _counters(server)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"bench_serving failed ({done.returncode}):\n{done.stderr[-4000:]}")
    after = _counters(server)
    result = json.loads(out.read_text().splitlines()[-1])
    prompt = after[COUNTERS[0]] - before[COUNTERS[0]]
    cached = after[COUNTERS[1]] - before[COUNTERS[1]]
    return {"seed": seed, "request_throughput": result["request_throughput"], "duration_s": result["duration"],
            "completed": result["completed"], "median_ttft_ms": result["median_ttft_ms"],
            "median_tpot_ms": result.get("median_tpot_ms"), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": cached / prompt}


def measure(name: str, tree: Path, args: argparse.Namespace, seeds: list[int], work: Path) -> list[dict[str, Any]]:
    from hypic.server.launch import start_server
    # `hypic serve` under PYTHONPATH=TREE imports that tree's package (its Ray workers too)
    server = start_server([*CONFIGS[name], "--log-level", "warning"], work / f"{name}.log", threads=1, timeout_s=600,
                          prefix=["env", f"PYTHONPATH={tree}"])
    try:
        return [{"config": name, **_bench(server, args, seed, work / f"{name}-{seed}.jsonl")} for seed in seeds]
    finally:
        server.stop()


def _report(summary: dict[str, dict[str, float]], runs: int) -> float:
    """Prints the medians and each replicated server against the one; returns dp2's req/s ratio."""
    print(f"medians of {runs}: " + "; ".join(f"{name} {values}" for name, values in summary.items()))
    one = summary["one"]
    for name in (n for n in summary if n != "one"):
        speed = summary[name]["request_throughput"] / one["request_throughput"]
        print(f"{name} / one: req/s {speed:.2f}x (target >= 1.5x), cached share "
              f"{summary[name]['cached_share'] - one['cached_share']:+.3f} (target >= 0)")
    return summary["dp2"]["request_throughput"] / one["request_throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--client-path", required=True, help="where sglang's client is installed (a --target folder)")
    parser.add_argument("--runs", type=int, default=3, help="runs per server, alternating servers")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--baseline", help="a commit whose --dp-size 2 takes its turn as dp2-before")
    parser.add_argument("--json", type=Path, help="write every run's record here")
    args = parser.parse_args()
    work, rows = Path(tempfile.mkdtemp()), []
    trees = {"one": ROOT, "dp2": ROOT, **({"dp2-before": checkout(args.baseline)} if args.baseline else {})}
    try:
        for run in range(args.runs):  # the servers take turns, so drift on the box hits them alike
            for name, tree in trees.items():
                rows += measure(name, tree, args, [1000 * (run + 1) + args.output_len], work)
                print(json.dumps(rows[-1]), flush=True)
    finally:
        if args.baseline:
            remove(trees["dp2-before"])
    summary = {name: {key: statistics.median(row[key] for row in rows if row["config"] == name)
                      for key in ("request_throughput", "cached_share", "median_ttft_ms")} for name in trees}
    ratio = _report(summary, args.runs)
    if args.json:
        from hypic.evaluation.cluster import machine
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "machine": machine(),
                                         "runs": rows, "summary": summary, "dp2_over_one": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
