"""Segment-parallel prefill of cold documents on Ray workers: TTFT vs worker count (paper Fig. 14).

A request of ``--docs`` cold documents of ``--doc-tokens`` tokens each (the paper's 11 x 2.4k)
runs through ``hypic.router.Router`` with 1 and 2 workers (``--workers``), ``--threads`` compute
threads each. The model is random weights with the default model's architecture and 32k
positions (the default model has 8k; timing does not depend on the weights), with a byte-level
tokenizer (one token per byte). Each request's TTFT (``max_new_tokens=1``) splits into

- dispatch: until the last cold document is prefilled on its builder (LPT over the workers);
- transfer: until the combine node has received, checked and stored the peers' entries;
- combine: the combine pass (seams, question, attention over the spliced KV) and the first token.

A simulator calibrated on the measured points (per-token build cost, per-byte transfer cost,
combine cost) predicts more workers: dispatch = LPT makespan of the documents' costs, transfer
= the bytes the combine node receives, combine = constant. It stops gaining where every
document has its own worker (the makespan is one document) and the combine pass dominates.

    python eval/bench_router.py --json /tmp/router.json
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from hypic import DEFAULT_SEPARATOR, Engine, default_model_path
from hypic.checkpoints import write_random_checkpoint
from hypic.router import Router, lpt_assign, makespan

WORDS = "river stone field north market harbour winter garden copper lantern violet orchard".split()


def make_checkpoint(path: Path) -> Path:
    """Random weights, the default model's shapes, 32k positions."""
    config = json.loads((default_model_path() / "config.json").read_text())
    fields = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                                     "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
                                     "layer_types", "rope_parameters")}
    return write_random_checkpoint(path, "qwen3_5_text", seed=0, **fields, max_position_embeddings=32768)


def document(tokens: int, seed: int) -> str:
    """``tokens`` bytes of words (the byte-level tokenizer makes one token per byte)."""
    rng, text = random.Random(seed), f"Document {seed}:"
    while len(text) < tokens:
        text += " " + rng.choice(WORDS)
    return text[:tokens]


def prompt(count: int, tokens: int, seed: int) -> str:
    docs = [document(tokens, 1000 * seed + i) for i in range(count)]
    return DEFAULT_SEPARATOR.join(["Read the documents.", *docs, "Question: which word comes first?\nAnswer:"])


def measure(model: Path, workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median phases over ``--repeats`` cold requests, and the entry bytes shipped per document."""
    router = Router(str(model), workers=workers, threads=args.threads)
    try:
        router.generate(prompt(2, 300, 999), max_new_tokens=1)  # warm the processes up
        runs = []
        for repeat in range(args.repeats):
            start = time.perf_counter()
            routed = router.generate(prompt(args.docs, args.doc_tokens, workers * 100 + repeat), max_new_tokens=1)
            runs.append({"total": time.perf_counter() - start, "dispatch": routed.dispatch_s,
                         "transfer": routed.transfer_s, "combine": routed.combine_s,
                         "shipped_docs": sum(len(j) for w, j in routed.plan.builds.items() if w != routed.plan.combine)})
            print(f"  {workers} worker(s), run {repeat}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1].items()), flush=True)
    finally:
        router.shutdown()
        ray.shutdown()
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def single_engine(model: Path, args: argparse.Namespace) -> float:
    """The same cold request in one process without Ray (the default deployment)."""
    import torch

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(str(model))
    times = []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        engine.generate(prompt(args.docs, args.doc_tokens, 50 + repeat), max_new_tokens=1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def simulate(points: dict[int, dict[str, Any]], args: argparse.Namespace, counts: list[int]) -> dict[int, float]:
    """TTFT predicted for each worker count from the 1- and 2-worker measurements."""
    costs = [args.doc_tokens] * args.docs
    per_token = points[1]["dispatch"] / sum(costs)
    shipped = points[2]["shipped_docs"] or 1
    per_doc_transfer = points[2]["transfer"] / shipped
    combine = statistics.mean(p["combine"] for p in points.values())
    predicted = {}
    for n in counts:
        assignment = lpt_assign(costs, [0] * n)
        combine_node = max(range(n), key=lambda w: assignment.count(w))
        received = sum(1 for w in assignment if w != combine_node)
        predicted[n] = per_token * makespan(costs, [0] * n, assignment) + per_doc_transfer * received + combine
    return predicted


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=11, help="cold documents per request (default: 11)")
    parser.add_argument("--doc-tokens", type=int, default=2400, help="tokens per document (default: 2400)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts measured (default: 1 2)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per worker (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="requests per point, median (default: 3)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(Path(tmp) / "model")
        baseline = single_engine(model, args)
        print(f"single engine, no Ray: {baseline:.3f} s", flush=True)
        points = {n: measure(model, n, args) for n in args.workers}
    print(f"\n{'workers':>8}{'TTFT s':>9}{'dispatch':>10}{'transfer':>10}{'combine':>9}{'speed-up':>10}")
    for n, point in points.items():
        print(f"{n:>8}{point['total']:>9.3f}{point['dispatch']:>10.3f}{point['transfer']:>10.3f}"
              f"{point['combine']:>9.3f}{points[min(points)]['total'] / point['total']:>10.2f}")
    results: dict[str, Any] = {"single_engine_s": baseline, "measured": points}
    if 1 in points and 2 in points:
        predicted = simulate(points, args, [1, 2, 4, 8, 11, 16, 64])
        print("\nsimulated TTFT s: " + ", ".join(f"{n}: {t:.3f}" for n, t in predicted.items()))
        print("simulated speed-up: " + ", ".join(f"{n}: {predicted[1] / t:.2f}" for n, t in predicted.items()))
        results["simulated"] = predicted
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
