"""Serving load benchmark: HYPIC vs prefix caching vs full recompute under a RAG workload.

For each ``--modes`` entry a ``hypic serve --mode M`` process is started (one at a time, on the
same machine and model), warmed with ``--warm-requests`` requests of the workload, then driven by
an asyncio client with Poisson arrivals at increasing QPS (``--qps-start`` times ``--qps-factor``
per level, each level ``--duration`` seconds of arrivals) until the median time to first token
passes ``--target-ttft`` (or ``--max-qps``).

Workloads (``--workload``):
- ``rag`` (default): every request is ``L SEP D1 SEP ... SEP Dk SEP Q`` with k =
  ``--docs-per-request`` documents drawn without replacement from a pool of ``--docs`` by a Zipf
  law (``--zipf``): popular documents recur at different positions behind different leading
  segments, as in RAG.
- ``shared-prefix``: plain prompts (no separators) in ``--groups`` groups, each group's requests
  sharing one long system prompt (``--system-words`` words) followed by its own question: the
  shape of SGLang's "generated shared prefix" benchmark, where prefix caching must hit.

Printed per mode and QPS level: TTFT p50/p90/p99 (server-side, from arrival to first token,
queueing included), output and prompt token throughput, and the hit rate (cached / prompt
tokens). Then, per mode, the QPS at which p50 TTFT reaches the target (log-linear interpolation
between the two levels around it) and the ratio hypic / prefix, with a PASS/FAIL line for the
target ratio (``--target-ratio``, default 2: issue 3's bar; the paper reports 1.28-2.83x).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from hypic import DEFAULT_SEPARATOR
from hypic.server.launch import ServerProcess, start_server

WORDS = ("river city company founder year product capital language mayor population museum bridge harbor "
         "market council festival library station garden tower valley forest island school hospital").split()


@dataclass(frozen=True)
class Workload:
    """A deterministic stream of RAG prompts over a Zipf-popular document pool."""

    documents: list[str]
    leading: list[str]
    docs_per_request: int
    zipf: float
    seed: int

    def prompts(self, count: int, offset: int) -> list[str]:
        """``count`` prompts; ``offset`` selects an independent slice of the stream."""
        rng = random.Random(self.seed * 1_000_003 + offset)
        weights = [1 / (rank + 1) ** self.zipf for rank in range(len(self.documents))]
        prompts = []
        for index in range(count):
            chosen: list[int] = []
            while len(chosen) < self.docs_per_request:
                pick = rng.choices(range(len(self.documents)), weights)[0]
                if pick not in chosen:
                    chosen.append(pick)
            parts = [rng.choice(self.leading), *(self.documents[i] for i in chosen),
                     f"\n\nQuestion {offset}-{index}: which {rng.choice(WORDS)} is mentioned? Answer:"]
            prompts.append(DEFAULT_SEPARATOR.join(parts))
        return prompts


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Plain prompts: a group's long system prompt, then a question of its own."""

    systems: list[str]
    seed: int

    def prompts(self, count: int, offset: int) -> list[str]:
        rng = random.Random(self.seed * 1_000_003 + offset)
        return [f"{rng.choice(self.systems)}\n\nQuestion {offset}-{index}: which {rng.choice(WORDS)} and which "
                f"{rng.choice(WORDS)} are mentioned? Answer:" for index in range(count)]


def make_workload(args: argparse.Namespace) -> Workload | SharedPrefixWorkload:
    rng = random.Random(args.seed)
    if args.workload == "shared-prefix":
        systems = [f"System prompt {g}: " + " ".join(rng.choice(WORDS) for _ in range(args.system_words)) + "."
                   for g in range(args.groups)]
        return SharedPrefixWorkload(systems, args.seed)
    documents = []
    for index in range(args.docs):
        words = [rng.choice(WORDS) for _ in range(args.doc_words)]
        documents.append(f"\n\nDocument {index}: " + " ".join(words) + ".")
    leading = [f"System prompt variant {v}: answer from the documents below." for v in range(4)]
    return Workload(documents, leading, args.docs_per_request, args.zipf, args.seed)


@dataclass
class LevelResult:
    """One QPS level of one mode."""

    mode: str
    qps: float
    requests: int
    failed: int
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    output_tokens_per_s: float
    prompt_tokens_per_s: float
    hit_rate: float
    wall_s: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def _one(client: httpx.AsyncClient, url: str, prompt: str, delay: float, output_tokens: int) -> dict[str, Any] | None:
    await asyncio.sleep(delay)
    body = {"text": prompt, "sampling_params": {"max_new_tokens": output_tokens, "temperature": 0, "ignore_eos": True}}
    try:
        response = await client.post(url + "/generate", json=body)
    except httpx.HTTPError:
        return None
    return response.json()["meta_info"] if response.status_code == 200 else None


async def run_level(url: str, prompts: list[str], qps: float, output_tokens: int, seed: int, mode: str) -> LevelResult:
    """Send ``prompts`` with Poisson arrivals at ``qps``; wait for every answer."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += rng.expovariate(qps)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=1000)) as client:
        metas = await asyncio.gather(*(_one(client, url, p, a, output_tokens) for p, a in zip(prompts, arrivals)))
    wall = time.perf_counter() - start
    done = [m for m in metas if m is not None]
    ttfts = [m["ttft"] for m in done] or [float("inf")]
    prompt_tokens = sum(m["prompt_tokens"] for m in done)
    return LevelResult(mode, qps, len(prompts), len(prompts) - len(done), percentile(ttfts, 0.5), percentile(ttfts, 0.9),
                       percentile(ttfts, 0.99), sum(m["completion_tokens"] for m in done) / wall, prompt_tokens / wall,
                       sum(m["cached_tokens"] for m in done) / max(prompt_tokens, 1), wall)


def qps_at_target(levels: list[LevelResult], target: float) -> float | None:
    """Log-linear interpolation of the QPS where p50 TTFT crosses ``target``; None if never below it."""
    below = [lv for lv in levels if lv.ttft_p50_s < target]
    if not below:
        return None
    low = max(below, key=lambda lv: lv.qps)
    above = [lv for lv in levels if lv.qps > low.qps and lv.ttft_p50_s >= target]
    if not above:
        return low.qps  # never crossed within the ladder: a lower bound
    high = min(above, key=lambda lv: lv.qps)
    frac = (math.log(target) - math.log(low.ttft_p50_s)) / (math.log(high.ttft_p50_s) - math.log(low.ttft_p50_s))
    return math.exp(math.log(low.qps) + frac * (math.log(high.qps) - math.log(low.qps)))


@dataclass
class ModeResult:
    mode: str
    warm_s: float
    levels: list[LevelResult] = field(default_factory=list)
    qps_at_target: float | None = None


def bench_mode(mode: str, workload: Workload | SharedPrefixWorkload, args: argparse.Namespace,
               log_dir: Path) -> ModeResult:
    """Start a server in ``mode``, warm it, climb the QPS ladder."""
    server_args = ["--mode", mode, "--seam-width", str(args.seam_width), "--log-level", "warning",
                   "--max-running-requests", str(args.max_running)]
    server: ServerProcess = start_server(server_args + (["--model", args.model] if args.model else []),
                                         log_dir / f"server-{mode}.log", threads=args.threads)
    try:
        start = time.perf_counter()
        for prompt in tqdm(workload.prompts(args.warm_requests, offset=0), desc=f"{mode}: warm-up", disable=not args.progress):
            server.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        result = ModeResult(mode, time.perf_counter() - start)
        qps, level = args.qps_start, 1
        with tqdm(desc=f"{mode}: QPS ladder", disable=not args.progress) as bar:
            while qps <= args.max_qps:
                prompts = workload.prompts(max(args.min_requests, round(qps * args.duration)), offset=level)
                result.levels.append(asyncio.run(run_level(server.url, prompts, qps, args.output_tokens, args.seed + level, mode)))
                bar.set_postfix(qps=f"{qps:.2f}", p50=f"{result.levels[-1].ttft_p50_s:.2f}s")
                bar.update()
                if result.levels[-1].ttft_p50_s >= args.target_ttft:
                    break
                qps, level = qps * args.qps_factor, level + 1
        result.qps_at_target = qps_at_target(result.levels, args.target_ttft)
        return result
    finally:
        server.stop()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the server's default model)")
    parser.add_argument("--modes", nargs="+", default=["hypic", "prefix", "full"], choices=["hypic", "prefix", "full", "naive"])
    parser.add_argument("--workload", choices=["rag", "shared-prefix"], default="rag",
                        help="rag: PIC prompts over a Zipf document pool; shared-prefix: plain prompts sharing "
                             "long system prompts (default: rag)")
    parser.add_argument("--groups", type=int, default=4, help="shared-prefix: system prompts (default: 4)")
    parser.add_argument("--system-words", type=int, default=300,
                        help="shared-prefix: words per system prompt (default: 300)")
    parser.add_argument("--docs", type=int, default=40, help="documents in the pool (default: 40)")
    parser.add_argument("--doc-words", type=int, default=120, help="words per document (default: 120)")
    parser.add_argument("--docs-per-request", type=int, default=4, help="documents per prompt (default: 4)")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of document popularity (default: 1.1)")
    parser.add_argument("--warm-requests", type=int, default=20, help="untimed requests before the ladder (default: 20)")
    parser.add_argument("--duration", type=float, default=15.0,
                        help="seconds of arrivals per QPS level: a level sends max(--min-requests, QPS x duration) "
                             "requests, so a saturated server builds a queue as it would in steady state (default: 15)")
    parser.add_argument("--min-requests", type=int, default=10, help="fewest requests per QPS level (default: 10)")
    parser.add_argument("--qps-start", type=float, default=0.25, help="first QPS level (default: 0.25)")
    parser.add_argument("--qps-factor", type=float, default=1.5, help="QPS growth per level (default: 1.5)")
    parser.add_argument("--max-qps", type=float, default=64.0, help="stop the ladder above this QPS (default: 64)")
    parser.add_argument("--target-ttft", type=float, default=1.0, help="p50 TTFT that defines a mode's capacity, s (default: 1)")
    parser.add_argument("--target-ratio", type=float, default=2.0, help="required hypic/prefix capacity ratio (default: 2)")
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens generated per request (default: 8)")
    parser.add_argument("--seam-width", type=int, default=8, help="server seam width (default: 8)")
    parser.add_argument("--max-running", type=int, default=64, help="server --max-running-requests (default: 64)")
    parser.add_argument("--threads", type=int, default=1, help="server torch threads (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    return parser


def report(results: list[ModeResult], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table and the capacity ratio; return everything as a dict."""
    print(f"\n{'mode':<8}{'qps':>7}{'p50 s':>8}{'p90 s':>8}{'p99 s':>8}{'out tok/s':>11}{'prompt tok/s':>14}{'hit rate':>10}{'failed':>8}")
    for result in results:
        for lv in result.levels:
            print(f"{lv.mode:<8}{lv.qps:>7.2f}{lv.ttft_p50_s:>8.3f}{lv.ttft_p90_s:>8.3f}{lv.ttft_p99_s:>8.3f}"
                  f"{lv.output_tokens_per_s:>11.1f}{lv.prompt_tokens_per_s:>14.0f}{lv.hit_rate:>10.1%}{lv.failed:>8}")
    capacity = {r.mode: r.qps_at_target for r in results}
    for mode, qps in capacity.items():
        print(f"{mode}: QPS at p50 TTFT {args.target_ttft:g} s = " + (f"{qps:.2f}" if qps else "below the first level"))
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "capacity_qps": capacity,
                           "modes": [asdict(r) for r in results]}
    if args.workload == "rag" and capacity.get("hypic") and capacity.get("prefix"):
        ratio = capacity["hypic"] / capacity["prefix"]
        passed = ratio >= args.target_ratio
        print(f"hypic / prefix capacity: {ratio:.2f}x (target >= {args.target_ratio:g}x): {'PASS' if passed else 'FAIL'}")
        out.update(ratio=ratio, passed=passed)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    workload = make_workload(args)
    with tempfile.TemporaryDirectory() as logs:
        results = [bench_mode(mode, workload, args, Path(logs)) for mode in args.modes]
    out = report(results, args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
