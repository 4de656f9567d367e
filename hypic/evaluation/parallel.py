"""``hypic eval parallel``: a cold request's TTFT against the number of Ray workers, broken into
dispatch, transfer and combine (paper Fig. 14).

One request of ``--docs`` cold documents of ``--doc-tokens`` tokens each (the paper's 11 x 2.4k)
runs through ``hypic.router.Router`` at each ``--workers`` count, ``--threads`` compute threads
per worker, and once on a single engine in this process without Ray (the default deployment).
Each request has documents of its own, so nothing is cached; TTFT is ``max_new_tokens=1``:

- dispatch: until the last cold document is prefilled on its builder (LPT over the workers);
- transfer: until the combine node has received, checked and stored the peers' entries;
- combine: what is left of the combine pass (seams, question, attention over the spliced KV) once
  every entry is in, and the first token: the combine node combines the head of the prompt it
  holds while the last documents are still on their way (``combined_early`` tokens).

``--model random`` (the default) is random weights with the shipped model's shapes and 32k
positions and a byte-level tokenizer: timing does not depend on the weights. A simulator
calibrated on the 1- and 2-worker points (per-token build cost, per-document transfer cost, the
combine pass) predicts more workers: LPT builds, the combine node combining each document once
everything before it has arrived (``early_ttft``). Records
go to ``OUT/parallel.jsonl`` one request at a time; a rerun measures only what is missing.
"""
import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypic import Engine, default_model_path
from hypic.loading.checkpoints import write_random_checkpoint
from hypic.tokenizer import TextTokenizer

from .data import DataError
from .results import ResultLog
from .scaling import build_prompt, make_document
from .studies import pyplot, save_figure

SIMULATED_COUNTS = (1, 2, 4, 8, 16, 32)
ENGINE = 0  # the worker count recorded for the single engine without Ray


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The parallel study's options."""
    parser.add_argument("--model", default="random",
                        help="random (the shipped model's shapes, random weights, 32k positions), default, or a "
                             "checkpoint directory")
    parser.add_argument("--docs", type=int, default=11, help="cold documents per request")
    parser.add_argument("--doc-tokens", type=int, default=2400, help="tokens per document")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts measured")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    parser.add_argument("--repeats", type=int, default=3, help="requests per point (median)")
    parser.add_argument("--transfer", choices=["torch", "ray"], default="torch",
                        help="how entries travel to the combine node: torch.distributed (gloo) or Ray's object store")
    parser.add_argument("--out", type=Path, default=Path("eval/runs"), help="folder of the JSONL, summary and figure")
    parser.add_argument("--no-progress", action="store_true")


def random_default_shapes(path: Path) -> Path:
    """Random weights with the shipped model's shapes and 32k positions, byte-level tokenizer."""
    config = json.loads((default_model_path() / "config.json").read_text())
    fields = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                                     "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
                                     "layer_types", "rope_parameters")}
    return write_random_checkpoint(path, "qwen3_5_text", seed=0, **fields, max_position_embeddings=32768)


def cold_prompt(tokenizer: TextTokenizer, docs: int, doc_tokens: int, seed: str) -> str:
    """A prompt of ``docs`` documents nobody has seen (``seed`` names them)."""
    return build_prompt([make_document(tokenizer, doc_tokens, random.Random(f"{seed}-{i}")) for i in range(docs)])


def _record(shape: str, workers: int, repeat: int, ttft: float, **phases: Any) -> dict[str, Any]:
    method = "engine" if workers == ENGINE else "router"
    return {"dataset": shape, "sample": f"workers={workers}/{repeat}", "method": method, "workers": workers,
            "repeat": repeat, "ttft_s": ttft, **phases}


def measure_router(model: Path, workers: int, args: argparse.Namespace, results: ResultLog, shape: str,
                   tokenizer: TextTokenizer, progress: Any) -> None:
    """The missing repeats of ``workers`` workers, each a cold request through a fresh router."""
    import ray

    from hypic.router import Router
    missing = [r for r in range(args.repeats) if not results.get((shape, f"workers={workers}/{r}", "router"))]
    progress.update(args.repeats - len(missing))
    if not missing:
        return
    router = Router(str(model), workers=workers, threads=args.threads, transfer=args.transfer)
    try:
        router.generate(cold_prompt(tokenizer, 2, min(300, args.doc_tokens), "warm"), max_new_tokens=1)
        for repeat in missing:
            prompt = cold_prompt(tokenizer, args.docs, args.doc_tokens, f"w{workers}-r{repeat}")
            start = time.perf_counter()
            routed = router.generate(prompt, max_new_tokens=1)
            shipped = sum(len(jobs) for w, jobs in routed.plan.builds.items() if w != routed.plan.combine)
            results.add(_record(shape, workers, repeat, time.perf_counter() - start, dispatch_s=routed.dispatch_s,
                                transfer_s=routed.transfer_s, combine_s=routed.combine_s, shipped_docs=shipped,
                                combined_early=routed.combined_early,
                                segments_missed=routed.result.segments_missed))
            progress.update()
    finally:
        router.shutdown()
        ray.shutdown()


def measure_engine(model: Path, args: argparse.Namespace, results: ResultLog, shape: str,
                   tokenizer: TextTokenizer, progress: Any) -> None:
    """The missing repeats of the same cold request on one engine in this process, no Ray."""
    import torch

    missing = [r for r in range(args.repeats) if not results.get((shape, f"workers={ENGINE}/{r}", "engine"))]
    progress.update(args.repeats - len(missing))
    if not missing:
        return
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(str(model))
    for repeat in missing:
        prompt = cold_prompt(tokenizer, args.docs, args.doc_tokens, f"engine-r{repeat}")
        start = time.perf_counter()
        engine.generate(prompt, max_new_tokens=1)
        results.add(_record(shape, ENGINE, repeat, time.perf_counter() - start))
        progress.update()


def summarize_parallel(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per worker count (0: the single engine): medians of TTFT and its phases, speed-up over the fewest workers."""
    rows = []
    for workers in sorted({r["workers"] for r in records}):
        mine = [r for r in records if r["workers"] == workers]
        row: dict[str, Any] = {"workers": workers, "n": len(mine)}
        for key in ("ttft_s", "dispatch_s", "transfer_s", "combine_s", "shipped_docs", "combined_early"):
            values = [r[key] for r in mine if key in r]
            row[key] = statistics.median(values) if values else None
        rows.append(row)
    routed = [r for r in rows if r["workers"] != ENGINE]
    for row in routed:
        row["speedup"] = routed[0]["ttft_s"] / row["ttft_s"]
    return rows


def simulate(rows: Sequence[dict[str, Any]], docs: int, doc_tokens: int,
             counts: Sequence[int] = SIMULATED_COUNTS) -> dict[int, float]:
    """TTFT predicted per worker count from the measured rows ({} without the 1- and 2-worker ones):
    per-token build cost and the whole combine pass from the 1-worker point (nothing overlaps
    there), per-document transfer from the 2-worker one; the request then runs as ``early_ttft``."""
    by_workers = {r["workers"]: r for r in rows}
    if 1 not in by_workers or 2 not in by_workers:
        return {}
    costs = [doc_tokens] * docs
    per_token = by_workers[1]["dispatch_s"] / sum(costs)
    per_doc_transfer = by_workers[2]["transfer_s"] / max(by_workers[2]["shipped_docs"], 1)
    return {n: early_ttft(costs, n, per_token, per_doc_transfer, by_workers[1]["combine_s"]) for n in counts}


def early_ttft(costs: Sequence[int], workers: int, per_token: float, per_doc_transfer: float, combine: float) -> float:
    """A cold request's TTFT as the router runs it: documents by LPT with the combine pass counted
    (in build tokens) on the combine node, worker 0; each worker builds its documents in prompt
    order and ships each when done; once its own are built, the combine node combines each
    document as soon as it and every one before it has arrived (the combine pass split evenly
    over the documents: their seams cost alike)."""
    from hypic.router import lpt_assign
    loads = [round(combine / per_token)] + [0] * (workers - 1)
    clock, arrivals = [0.0] * workers, []
    for cost, worker in zip(costs, lpt_assign(costs, loads)):
        clock[worker] += cost * per_token
        arrivals.append(clock[worker] + (per_doc_transfer if worker else 0.0))
    now = clock[0]
    for arrival in arrivals:
        now = max(now, arrival) + combine / len(costs)
    return now


def format_parallel(rows: Sequence[dict[str, Any]], predicted: dict[int, float]) -> str:
    """A Markdown table of the measured points, then the simulated TTFT and speed-up."""
    lines = ["| workers | n | TTFT s | dispatch s | transfer s | combine s | shipped docs | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]:.3f}" if r[k] is not None else "" for k in ("dispatch_s", "transfer_s", "combine_s")]
        name = "1 engine, no Ray" if r["workers"] == ENGINE else str(r["workers"])
        lines.append(f"| {name} | {r['n']} | {r['ttft_s']:.3f} | {' | '.join(cells)} | "
                     f"{'' if r['shipped_docs'] is None else format(r['shipped_docs'], 'g')} | "
                     f"{format(r['speedup'], '.2f') + 'x' if 'speedup' in r else ''} |")
    if predicted:
        lines += ["", "simulated TTFT s: " + ", ".join(f"{n}: {t:.3f}" for n, t in predicted.items()),
                  "simulated speed-up: " + ", ".join(f"{n}: {predicted[1] / t:.2f}x" for n, t in predicted.items())]
    return "\n".join(lines)


def parallel_figure(rows: Sequence[dict[str, Any]], predicted: dict[int, float], path: Path) -> None:
    """Stacked dispatch / transfer / combine bars per worker count; the simulated TTFT and the
    single engine as lines."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4.2))
    routed = [r for r in rows if r["workers"] != ENGINE]
    labels = [str(r["workers"]) for r in routed]
    bottom = [0.0] * len(routed)
    for key, name in (("dispatch_s", "dispatch (per-document prefill)"), ("transfer_s", "transfer"),
                      ("combine_s", "combine (seams, Q, first token)")):
        heights = [r[key] for r in routed]
        axes.bar(labels, heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for r in (r for r in rows if r["workers"] == ENGINE):
        axes.axhline(r["ttft_s"], linestyle="--", color="gray", label="1 engine, no Ray")
    if predicted:
        simulated = [n for n in predicted if str(n) not in labels]
        axes.scatter([str(n) for n in simulated], [predicted[n] for n in simulated], marker="x", color="black",
                     label="simulated")
    axes.set(xlabel="workers", ylabel="TTFT (s)", title="cold request: TTFT breakdown vs workers")
    axes.legend(fontsize=8)
    save_figure(figure, path)


def run_parallel(args: argparse.Namespace) -> dict[str, Any]:
    """The parallel study of ``args``: records, rows, simulation, and where they were written."""
    if args.docs < 1 or args.doc_tokens < 32 or args.repeats < 1 or args.threads < 1 or min(args.workers) < 1:
        raise DataError("--docs, --repeats, --threads and --workers must be >= 1, --doc-tokens >= 32")
    shape = f"{args.model}:{args.docs}x{args.doc_tokens}:t{args.threads}:{args.transfer}"
    results = ResultLog(args.out / "parallel.jsonl")
    print(f"hypic eval parallel: {args.docs} cold documents x {args.doc_tokens} tokens, workers "
          f"{', '.join(map(str, args.workers))}, {args.threads} thread(s) each, {args.repeats} repeats; "
          f"{len(results.records)} records already in {results.path}", file=sys.stderr)
    from tqdm import tqdm
    counts = sorted(set(args.workers))
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=(len(counts) + 1) * args.repeats, desc="parallel",
                                                    unit="request", disable=args.no_progress, file=sys.stderr) as bar:
        model = _model_dir(args.model, Path(tmp))
        tokenizer = TextTokenizer.from_dir(model)
        measure_engine(model, args, results, shape, tokenizer, bar)
        for workers in counts:
            measure_router(model, workers, args, results, shape, tokenizer, bar)
    records = [r for r in results.records.values() if r["dataset"] == shape
               and r["repeat"] < args.repeats and r["workers"] in {ENGINE, *args.workers}]
    rows = summarize_parallel(records)
    predicted = simulate(rows, args.docs, args.doc_tokens)
    summary = args.out / "parallel_summary.json"
    summary.write_text(json.dumps({"study": "parallel", "shape": shape, "rows": rows, "simulated_ttft_s": predicted},
                                  indent=2) + "\n")
    parallel_figure(rows, predicted, args.out / "parallel.png")
    print(format_parallel(rows, predicted))
    return {"records": records, "rows": rows, "simulated": predicted, "summary": summary,
            "figure": args.out / "parallel.png"}


def _model_dir(model: str, workdir: Path) -> Path:
    if model == "random":
        return random_default_shapes(workdir / "model")
    path = default_model_path() if model == "default" else Path(model)
    if not (path / "config.json").is_file():
        raise DataError(f"{path} is not a checkpoint directory (no config.json)")
    return path
