"""``hypic eval STUDY``: run a study on the in-process engine or a server, resumably, and report it.

Writes ``OUT/STUDY.jsonl`` (one record per sample and method; a rerun computes only what is
missing), ``OUT/STUDY_summary.json`` and ``OUT/STUDY.png``, and prints the summary table.
"""
import argparse
import contextlib
import copy
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from hypic import Engine
from hypic.errors import HypicError
from hypic.cache.modes import Mode
from hypic.parallel import TensorParallel

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
    "cluster": "replicas behind the document-aware router (hypic serve --dp-size, each --router-policy) against one "
               "server and one pool as large as all of theirs, on a multi-tenant RAG workload: hit rate, TTFT, QPS "
               "at the SLO",
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
    for name, module in (("load", "load"), ("parallel", "parallel"), ("soak", "soak"), ("tiers", "tiers"),
                         ("cluster", "cluster")):
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
                               help="full, prefix, naive, hypic or hypic:W, hypic-bf16 or hypic-bf16:W (the public "
                                    "pool's T_C and S_C|0 stored in bfloat16; full always runs: the reference)")
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
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, of each rank with --tp-size "
                        "(1 gives steady timings)")
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1,
                        help="run the in-process engine as N tensor-parallel ranks, one process each (pareto, "
                             "seam); rank 0 times the requests and writes the results")
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


def _target(args: argparse.Namespace, tp: TensorParallel = TensorParallel()) -> Target:
    if args.url is not None:
        return ServerTarget(args.url)
    if args.threads:
        torch.set_num_threads(args.threads)
    return EngineTarget(Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, tp=tp))


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
    if args.tp_size != 1:
        return _run_on_ranks(args, methods, samples)
    return _run_study(args, _target(args), methods, samples)


def _run_study(args: argparse.Namespace, target: Target, methods: list[Method], samples: list) -> dict:
    results = ResultLog(args.out / f"{args.study}.jsonl")
    warm = not args.cold
    print(f"hypic eval {args.study}: {len(samples)} {args.dataset} samples from {args.data or SYNTHETIC_DEFAULT}, "
          f"methods {', '.join(m.label for m in methods)}; warm-up: {WARM_UP if warm else 'none (cold)'}; "
          f"{len(results.records)} records already in {results.path}", file=sys.stderr)
    if args.study == "drift":
        assert isinstance(target, EngineTarget)
        records = run_drift(target.engine, samples, methods, warm, results, progress=not args.no_progress)
        rows, table, draw = summarize_drift(records), format_drift, drift_figure
    else:
        records = run_study(target, samples, methods, warm, results, progress=not args.no_progress)
        rows, table, draw = summarize(records), format_summary, FIGURES[args.study]
    summary = args.out / f"{args.study}_summary.json"
    ranks = target.engine.model.config.tensor_parallel.size if isinstance(target, EngineTarget) else None
    summary.write_text(json.dumps({"study": args.study, "warm": warm, "tp_size": ranks, "rows": rows}, indent=2) + "\n")
    draw(rows, args.out / f"{args.study}.png")
    print(table(rows))
    return {"records": records, "rows": rows, "summary": summary, "figure": args.out / f"{args.study}.png"}


def _run_on_ranks(args: argparse.Namespace, methods: list[Method], samples: list) -> dict:
    """The study run by ``--tp-size`` ranks in step, each on its shard of the model. Every rank runs
    every request (the ranks compute each one together); the others start from a copy of the
    records already written, so that all resume at the same sample, and write to folders thrown away.
    This process is rank 0; a rank that dies or hangs ends the run, named (``RankGroup``)."""
    from hypic.parallel.group import GroupFailure
    from hypic.parallel.ranks import run_as_rank_zero
    if args.url is not None:
        raise DataError("--tp-size runs the in-process engine over several ranks; a server's ranks are set where it "
                        "starts (hypic serve --tp-size)")
    if args.study == "drift":
        raise DataError("the drift study reads whole recurrent states, which --tp-size splits across ranks: run it "
                        "with --tp-size 1")
    _check_tp_size(args.model, args.tp_size)
    with tempfile.TemporaryDirectory(prefix="hypic-eval-ranks-") as scratch:
        outs = [args.out] + [_copy_records(args, Path(scratch) / f"rank{rank}") for rank in range(1, args.tp_size)]
        try:
            return run_as_rank_zero(_study_on_rank, args.tp_size, args, outs, methods, samples,
                                    threads=args.threads or 1, device=args.device)
        except GroupFailure as err:
            raise HypicError(f"the tensor-parallel run cannot go on: {err}") from err


def _check_tp_size(model: str, tp_size: int) -> None:
    """Refuse a TP size the model's head counts do not divide, before any rank starts."""
    from hypic.loading.default_model import default_model_path
    from hypic.loading.loader import read_config
    from hypic.parallel.sharding import rank_config
    if tp_size < 1:
        raise DataError("--tp-size must be >= 1")
    rank_config(read_config(default_model_path() if model == "default" else Path(model)), TensorParallel(0, tp_size))


def _copy_records(args: argparse.Namespace, folder: Path) -> Path:
    folder.mkdir(parents=True)
    records = args.out / f"{args.study}.jsonl"
    if records.is_file():
        shutil.copy(records, folder / records.name)
    return folder


def _study_on_rank(tp: TensorParallel, args: argparse.Namespace, outs: list[Path], methods: list[Method],
                   samples: list) -> dict | None:
    """One rank's run of the study (rank 0 reports it; the others run silently)."""
    args = copy.copy(args)
    args.out = outs[tp.rank]
    if tp.rank == 0:
        return _run_study(args, _target(args, tp), methods, samples)
    args.no_progress = True
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        _run_study(args, _target(args, tp), methods, samples)
    return None


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
