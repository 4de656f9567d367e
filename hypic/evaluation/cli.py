"""``hypic eval STUDY``: run a study on the in-process engine or a server, resumably, and report it.

Writes ``OUT/STUDY.jsonl`` (one record per sample and method; a rerun computes only what is
missing), ``OUT/STUDY_summary.json`` and ``OUT/STUDY.png``, and prints the summary table.
"""
import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from hypic import Engine
from hypic.errors import HypicError
from hypic.cache.modes import Mode

from .data import DATASETS, DataError, load
from .drift import drift_figure, format_drift, run_drift, summarize_drift
from .methods import Method, MethodError, parse_method
from .results import ResultLog
from .studies import FIGURES, format_summary, run_study, summarize
from .targets import EngineTarget, ServerTarget, Target, TargetError

SYNTHETIC_DEFAULT = Path("datasets/synthetic_qa/test.jsonl")
WARM_UP = ("every document seen before, in another prompt (hypic, naive: the documents cached; prefix: one "
           "earlier request per document, instruction + that document)")
STUDIES = {
    "pareto": "accuracy against p50 TTFT for each method (paper Fig. 10)",
    "seam": "accuracy and TTFT against the seam width w (paper Fig. 13)",
    "drift": "per linear layer, the final recurrent state's relative L2 error and angle against full recompute "
             "(paper Table 4; in-process only)",
}

SERVICE_STUDIES = {
    "load": "TTFT p50/p90/p99 and token throughput against QPS on a Prod-RAG-like trace (paper Fig. 11)",
    "parallel": "a cold request's TTFT against the number of Ray workers: dispatch, transfer, combine "
                "(paper Fig. 14)",
    "soak": "a shared server under steady mixed load with faults: wrong answers, 5xx, RSS, TTFT, recovery",
    "tiers": "the public pool's disk and Mooncake tiers: load latency per tier, time to the first hit after a "
             "restart, hit rate and TTFT as the document set outgrows memory (lru vs cost eviction), a chat continued "
             "on another server through Mooncake",
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and every option's default."""


def _module(name: str) -> Any:
    return importlib.import_module(f"{__package__}.{name}")


def _doc(name: str) -> str:
    return _module(name).__doc__ or ""


def add_eval_parser(commands: argparse._SubParsersAction) -> None:
    """``hypic eval`` and its studies, as subcommands of ``commands``."""
    parser = commands.add_parser("eval", help="accuracy and TTFT studies of HYPIC against full, prefix and naive",
                                 description="Accuracy-TTFT studies on your model and data. Every sample runs on "
                                             "fresh pools; with the default warm-up policy every document was seen "
                                             "before the timed request, in another prompt: hypic and naive cached the "
                                             "documents, prefix served one earlier request per document (--cold: "
                                             "nothing is warmed).")
    studies = parser.add_subparsers(dest="study", required=True, metavar="STUDY")
    scaling = studies.add_parser("scaling", add_help=False, help="TTFT of hypic and full recompute as document "
                                 "length and count grow, every document cached (paper Fig. 12); --help for its options")
    scaling.set_defaults(options=[])  # hypic.cli hands it every argument after the study's name
    for name, module in (("load", "load"), ("parallel", "parallel"), ("soak", "soak"), ("tiers", "tiers")):
        study = studies.add_parser(name, help=SERVICE_STUDIES[name], description=_doc(module),
                                   formatter_class=_HelpFormatter)
        _module(module).add_arguments(study)
    for name, text in STUDIES.items():
        study = studies.add_parser(name, help=text, description=text,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        _common_options(study)
        if name in ("pareto", "drift"):
            default = ["full", "prefix", "naive", "hypic:8"] if name == "pareto" else ["naive", "hypic:0", "hypic:8"]
            study.add_argument("--methods", nargs="+", default=default,
                               help="full, prefix, naive, hypic or hypic:W (full always runs: the reference)")
        else:
            study.add_argument("--widths", type=int, nargs="+", default=[0, 4, 8, 16, 32], help="seam widths w")


def _common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=DATASETS, default="synthetic",
                        help="synthetic (datasets/synthetic_qa) or a LongBench task read from --data")
    parser.add_argument("--data", type=Path, default=None,
                        help=f"the dataset's JSONL file (default for synthetic: {SYNTHETIC_DEFAULT})")
    parser.add_argument("--limit", type=int, default=20, help="samples (the first N of the file)")
    parser.add_argument("--model", default="default", help="checkpoint directory, or default (the shipped model)")
    parser.add_argument("--url", default=None,
                        help="run against the server at URL (SGLang /generate; its own mode and seam width only) "
                             "instead of the in-process engine")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 gives steady timings)")
    parser.add_argument("--chunk-words", type=int, default=400,
                        help="LongBench contexts without passage markers are cut into documents of about this many words")
    parser.add_argument("--cold", action="store_true", help="no warm-up: documents are prefilled in the timed request")
    parser.add_argument("--out", type=Path, default=Path("eval/runs"), help="folder of the JSONL, summary and figure")
    parser.add_argument("--no-progress", action="store_true")


def _methods(args: argparse.Namespace) -> list[Method]:
    if args.study == "seam":
        if any(w < 0 for w in args.widths):
            raise MethodError("seam widths must be >= 0")
        return [Method(Mode.HYPIC, w) for w in args.widths]
    return [parse_method(text) for text in args.methods]


def _target(args: argparse.Namespace) -> Target:
    if args.url is not None:
        return ServerTarget(args.url)
    if args.threads:
        torch.set_num_threads(args.threads)
    return EngineTarget(Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype))


def run_eval(args: argparse.Namespace) -> dict:
    """The study of ``args``: records, summary rows and where they were written."""
    if args.limit is not None and args.limit < 1:
        raise DataError("--limit must be >= 1")
    methods = _methods(args)
    data = args.data or (SYNTHETIC_DEFAULT if args.dataset == "synthetic" else None)
    if data is None:
        raise DataError(f"--data is required for the LongBench dataset {args.dataset!r} (a local JSONL file)")
    if args.dataset == "synthetic" and args.data is None and not data.is_file():
        raise DataError(f"{data} does not exist: generate the synthetic test split with `python -m "
                        "hypic_data.synthetic_qa --out datasets/synthetic_qa --splits test` or pass --data")
    samples = load(args.dataset, data, args.limit, args.chunk_words)
    if args.study == "drift" and args.url is not None:
        raise DataError("the drift study reads the model's states, which a server does not expose: run it in process")
    target = _target(args)
    results = ResultLog(args.out / f"{args.study}.jsonl")
    warm = not args.cold
    print(f"hypic eval {args.study}: {len(samples)} {args.dataset} samples from {data}, methods "
          f"{', '.join(m.label for m in methods)}; warm-up: {WARM_UP if warm else 'none (cold)'}; "
          f"{len(results.records)} records already in {results.path}", file=sys.stderr)
    if args.study == "drift":
        assert isinstance(target, EngineTarget)
        records = run_drift(target.engine, samples, methods, warm, results, progress=not args.no_progress)
        rows, table, draw = summarize_drift(records), format_drift, drift_figure
    else:
        records = run_study(target, samples, methods, warm, results, progress=not args.no_progress)
        rows, table, draw = summarize(records), format_summary, FIGURES[args.study]
    summary = args.out / f"{args.study}_summary.json"
    summary.write_text(json.dumps({"study": args.study, "warm": warm, "rows": rows}, indent=2) + "\n")
    draw(rows, args.out / f"{args.study}.png")
    print(table(rows))
    return {"records": records, "rows": rows, "summary": summary, "figure": args.out / f"{args.study}.png"}


def eval_main(args: argparse.Namespace) -> int:
    """Run ``hypic eval``; bad input is a one-line error and exit status 2 (finished samples are kept)."""
    if args.study == "scaling":
        from . import scaling
        outcome = scaling.main(args.options)
        return 1 if outcome["strict"] and not outcome["all_passed"] else 0
    try:
        if args.study in SERVICE_STUDIES:
            getattr(_module(args.study), f"run_{args.study}")(args)
        else:
            run_eval(args)
    except (DataError, MethodError, TargetError, HypicError) as err:
        print(f"hypic eval: error: {err}", file=sys.stderr)
        return 2
    return 0
