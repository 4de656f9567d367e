"""A cache hit's host work: the torch ops an all-hit request dispatches, and its time against naive
addition and full recompute, for this tree's code and (``--baseline REV``) an earlier commit's.

Workload: documents of 150-200 words; each request names its documents in an order no earlier
request used, behind a short system prompt, with a short question after them; every document was
warmed first (an all-hit request: only seams, the system prompt's end and the question are
recomputed).

Part ``ops``: torch ops that reach the dispatcher (views included) while such a request is prefilled
(``prefill``: match, combine pass, keeping its states in the private pool; ``pass``: the combine
passes alone) at 2, 4, 8 and 16 documents, and during one decode step after the 16-document
request; the ops among them that would sync a GPU with the host (``hypic/evaluation/ops.py``). On
the 4-layer ``qwen3_5_text`` test model (random weights, 32k positions) and on the shipped model,
both fp32. Op counts do not depend on the machine.

Part ``time``: the shipped model in bfloat16 on ``--threads`` threads (1 by default): seconds from
planning to the first token's logits of an all-hit request with 4 and with 16 documents in modes
``hypic`` and ``naive`` (whole documents added without transitions, no seams), in mode ``seams``
(HYPIC's plan: the same seams recomputed and entries spliced, every document composed by addition
instead of ``T_C``; wrong like ``naive``, it prices the transitions, the rest of a hit being the
seams' compute), and of the same prompt under full recompute. Each point is measured on fresh pools
(flushed, the documents warmed again, untimed) so no request resumes from another's states.
``--rounds`` rounds, each a warm-up request per point, then ``--runs`` timed ones per point, the
points taken in turn; with a baseline the rounds alternate between the two trees (each in a process
of its own), so both see the same machine.

    python eval/bench_hit_host.py [--baseline REV] [--rounds 5] [--runs 2] [--json OUT]
"""
import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from worktrees import checkout, remove

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the river stone cloud paper lamp green quiet north city field market winter garden bridge tower "
         "engine signal harbor forest letter window music teacher doctor village summer number silver story "
         "morning evening island valley mountain kitchen station picture language history science").split()
DOCUMENT_COUNTS = (2, 4, 8, 16)
TIMED_COUNTS = (4, 16)
MODES = ("hypic", "seams", "naive", "full")
SEAMS = "seams"  # HYPIC's plan, its documents added without T_C


# ----- the worker: one tree's code ----------------------------------------------------------------------
def _counter_class() -> Any:
    """``OpCounter`` of this tree's ``hypic/evaluation/ops.py``, loaded by path (a baseline tree's
    ``hypic`` may not have it)."""
    spec = importlib.util.spec_from_file_location("hit_op_counter", ROOT / "hypic" / "evaluation" / "ops.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OpCounter


def documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"\n\nDocument {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(150, 200))) + "."
            for i in range(count)]


def prompt(docs: list[str], count: int, order_seed: int, separator: str = "<<PIC_SEP>>") -> str:
    """A request over the first ``count`` documents in an order drawn from ``order_seed``."""
    chosen = docs[:count]
    random.Random(order_seed).shuffle(chosen)
    return separator.join(["You answer from the documents.", *chosen, "\n\nQuestion: which document is longest?\nAnswer:"])


def _engine(path: str, dtype: str) -> Any:
    from hypic import Engine
    return Engine.from_pretrained(path, device="cpu", dtype=dtype, public_pool_bytes=1 << 30,
                                  private_pool_bytes=1 << 30)


def _tiny_model() -> str:
    from hypic.loading.checkpoints import write_random_checkpoint
    path = Path(tempfile.mkdtemp()) / "qwen3_5_text"
    write_random_checkpoint(path, "qwen3_5_text", 0, max_position_embeddings=32768)
    return str(path)


def _shipped_model() -> str:
    from hypic.loading.default_model import default_model_path
    return str(default_model_path())


def _prefill(engine: Any, text: str, mode: str) -> Any:
    from dataclasses import replace
    from hypic.assembler import drain
    plan = engine.plan(engine.parse(text), "hypic" if mode == SEAMS else mode)
    if mode == SEAMS:
        plan = replace(plan, policy=replace(plan.policy, transitions=False))
    return drain(engine.prefiller.prefill_steps(plan))


def _count_ops(engine: Any, docs: list[str], counter: Any) -> dict[str, Any]:
    """Ops of the all-hit prefill and of its combine passes at each document count, and of one
    decode step after the last; the syncs among them."""
    import hypic.assembler as assembler
    combine = assembler.combine_batch
    rows: dict[str, Any] = {}
    for count in DOCUMENT_COUNTS:
        engine.flush()
        engine.warmup(docs[:count])
        passes: list[Any] = []

        def counted(works: list, passes: list = passes) -> Any:
            with counter() as inner:
                out = combine(works)
            passes.append(inner)
            return out

        assembler.combine_batch = counted
        try:
            with counter() as whole:
                prefill = _prefill(engine, prompt(docs, count, 1000 + count), "hypic")
        finally:
            assembler.combine_batch = combine
        assert prefill.stats.segments_hit == count, (prefill.stats.segments_hit, count)
        rows[str(count)] = {"prefill_ops": whole.total, "pass_ops": sum(c.total for c in passes),
                            "syncs": dict(whole.syncs), "pass_syncs": dict(sum((c.syncs for c in passes), type(whole.syncs)())),
                            "recomputed_tokens": prefill.stats.recomputed_tokens}
    token = int(prefill.logits.argmax())
    with counter() as step:
        engine.runner.decode([prefill.state], [token])
    return {"documents": rows, "decode": {"ops": step.total, "syncs": dict(step.syncs)}}


def ops_part() -> dict[str, Any]:
    import torch
    torch.set_num_threads(1)
    counter, docs = _counter_class(), documents(max(DOCUMENT_COUNTS))
    return {name: _count_ops(_engine(path, "float32"), docs, counter)
            for name, path in (("qwen3_5_text-4-layer", _tiny_model()), ("shipped", _shipped_model()))}


def _timed(engine: Any, docs: list[str], mode: str, count: int, order_seed: int) -> float:
    engine.flush()
    if mode != "full":
        engine.warmup(docs[:count], "hypic" if mode == SEAMS else mode)
    text = prompt(docs, count, order_seed)
    start = time.perf_counter()
    prefill = _prefill(engine, text, mode)
    seconds = time.perf_counter() - start
    if mode != "full":
        assert prefill.stats.segments_hit == count, (mode, prefill.stats.segments_hit, count)
    return seconds


def time_part(threads: int, runs: int, round_number: int) -> dict[str, Any]:
    import torch
    torch.set_num_threads(threads)
    engine, docs = _engine(_shipped_model(), "bfloat16"), documents(max(TIMED_COUNTS))
    points = [(mode, count) for mode in MODES for count in TIMED_COUNTS]
    for mode, count in points:
        _timed(engine, docs, mode, count, 7)  # a warm-up, not kept
    found: dict[str, list[float]] = {f"{mode}/{count}": [] for mode, count in points}
    for run in range(runs):  # the points in turn, so a slow spell of the machine falls on all of them
        for mode, count in points:
            found[f"{mode}/{count}"].append(_timed(engine, docs, mode, count, 100 * round_number + run))
    return found


def worker(args: argparse.Namespace) -> None:
    import hypic
    out = {"hypic": str(Path(hypic.__file__).resolve().parent)}
    out |= ops_part() if args.worker == "ops" else {"seconds": time_part(args.threads, args.runs, args.round)}
    print(json.dumps(out))


# ----- the orchestrator ---------------------------------------------------------------------------------
def _run_worker(tree: Path, part: str, args: argparse.Namespace, round_number: int = 0) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree / "datasets")]), OMP_NUM_THREADS=str(args.threads))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", part, "--threads", str(args.threads),
               "--runs", str(args.runs), "--round", str(round_number)]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"the {part} worker on {tree} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["hypic"]) != (tree / "hypic").resolve():
        raise RuntimeError(f"the worker for {tree} imported hypic from {result['hypic']}")
    return result


def _medians(rounds: list[dict[str, list[float]]]) -> dict[str, float]:
    keys = rounds[0].keys()
    return {key: statistics.median(t for r in rounds for t in r[key]) for key in keys}


def _ratios(median: dict[str, float]) -> dict[str, float]:
    return {"hypic 16 / hypic 4": median["hypic/16"] / median["hypic/4"],
            "hypic / naive at 16": median["hypic/16"] / median["naive/16"],
            "hypic / seams at 16": median["hypic/16"] / median["seams/16"] if "seams/16" in median else float("nan"),
            "hypic / naive at 4": median["hypic/4"] / median["naive/4"],
            "full / hypic at 16": median["full/16"] / median["hypic/16"],
            "full / hypic at 4": median["full/4"] / median["hypic/4"]}


def _growth(rows: dict[str, Any], key: str) -> float:
    """Ops added per extra cached document, fitted between 8 and 16 documents."""
    return (rows["16"][key] - rows["8"][key]) / 8


def _print_ops(label: str, found: dict[str, Any]) -> None:
    for model, result in found.items():
        rows = result["documents"]
        counts = " ".join(f"{n}:{rows[n]['prefill_ops']}/{rows[n]['pass_ops']}" for n in rows)
        syncs = sum(sum(rows[n]["syncs"].values()) for n in rows)
        print(f"{label:>8} {model:<22} prefill/pass ops by documents {counts}; +{_growth(rows, 'prefill_ops'):.1f} "
              f"(+{_growth(rows, 'pass_ops'):.1f} in the pass) per document; decode step {result['decode']['ops']} ops; "
              f"syncs {syncs} in prefills, {sum(result['decode']['syncs'].values())} in the step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a commit to measure as well (checked out in a git worktree)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=2, help="timed requests per point and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--part", choices=("ops", "time", "all"), default="all")
    parser.add_argument("--json", help="write the raw data here")
    parser.add_argument("--worker", choices=("ops", "time"), help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from hypic.evaluation.cluster import machine
    trees = {"after": ROOT} | ({"before": checkout(args.baseline)} if args.baseline else {})
    report: dict[str, Any] = {"machine": machine(), "baseline": args.baseline, "threads": args.threads,
                              "rounds": args.rounds, "runs": args.runs}
    print(f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, ISA {' '.join(report['machine']['isa'])}")
    if args.part in ("ops", "all"):
        report["ops"] = {label: _run_worker(tree, "ops", args) for label, tree in trees.items()}
        for label, found in report["ops"].items():
            _print_ops(label, {k: v for k, v in found.items() if k != "hypic"})
    if args.part in ("time", "all"):
        rounds: dict[str, list] = {label: [] for label in trees}
        for number in range(args.rounds):
            for label, tree in sorted(trees.items(), key=lambda item: (item[0] == "after") == (number % 2 == 0)):
                rounds[label].append(_run_worker(tree, "time", args, number)["seconds"])
                print(f"round {number + 1}/{args.rounds} {label}: " + " ".join(
                    f"{k} {statistics.median(v) * 1e3:.1f}ms" for k, v in rounds[label][-1].items()), flush=True)
        report["time"] = {label: {"rounds": found, "median_s": _medians(found), "ratios": _ratios(_medians(found))}
                          for label, found in rounds.items()}
        for label, found in report["time"].items():
            print(f"{label:>8}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in found["median_s"].items()))
            print(f"{'':>8}  " + ", ".join(f"{k} {v:.2f}x" for k, v in found["ratios"].items()))
        if "before" in report["time"]:
            before, after = report["time"]["before"]["median_s"], report["time"]["after"]["median_s"]
            print("after / before: " + ", ".join(f"{k} {after[k] / before[k]:.2f}x" for k in after))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.baseline:
        remove(trees["before"])


if __name__ == "__main__":
    main()
