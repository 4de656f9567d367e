"""Task accuracy and state drift of HYPIC's prefill modes on the synthetic multi-document QA split.

What the default model must show: exact-match accuracy on the held-out test split under ``full``
recompute, ``hypic`` with seam widths w in {0, 4, 8, 16}, ``prefix`` and ``naive``, single-hop
and multi-hop apart (the paper's claim: HYPIC within a few points of full recompute, naive
addition far below); and the per-layer drift of the final recurrent state of every Gated
DeltaNet layer between each mode and ``full`` (the paper's Table 4 analog: relative L2 error
and angle, ~9 % and ~5 degrees at the deepest linear layer in the paper).

Every example is answered greedily by our ``Engine`` in each configuration, starting from
an empty cache: the documents of a request are prefilled alone (cache misses) and spliced
into the same request, which gives exactly the state a later cache hit would give. The
drift is measured on the state right after the prompt's prefill (before decoding).

Printed: a Markdown table (configuration, single-hop / multi-hop / overall accuracy,
agreement with full's answers, drift at the deepest linear layer), then a table of the drift
at every linear layer. ``--markdown`` and ``--json`` save them.

Examples::

    python eval/accuracy_sweep.py --limit 100          # first 100 single-hop + 100 multi-hop
    python eval/accuracy_sweep.py --model runs/tiny --split validation --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from hypic import Engine
from hypic_data.evaluate import exact_match
from hypic_data.synthetic_qa import build_prompt, read_jsonl
from hypic.evaluation.metrics import state_drift
from hypic.state import LinearLayerState

KINDS = ("single_hop", "multi_hop")


@dataclass(frozen=True)
class SweepConfig:
    """One prefill configuration: an engine mode and, for ``hypic``, its seam width and the precision
    its public pool stores T_C and S_C|0 in."""

    mode: str
    seam_width: int = 0
    state_cache_dtype: str = "float32"

    @property
    def label(self) -> str:
        if self.mode != "hypic":
            return self.mode
        return f"hypic w={self.seam_width}" + ("" if self.state_cache_dtype == "float32" else f" {self.state_cache_dtype}")


MODES = ("full", "hypic", "prefix", "naive")


def sweep_configs(widths: Sequence[int], modes: Sequence[str] = MODES,
                  state_cache_dtypes: Sequence[str] = ("float32",)) -> list[SweepConfig]:
    """``full`` first (the reference, always run), then ``hypic`` per width and state-cache dtype,
    ``prefix`` and ``naive``, each only if it is in ``modes``."""
    hypic = [SweepConfig("hypic", w, d) for w in widths for d in state_cache_dtypes]
    configs = [SweepConfig("full"), *hypic, SweepConfig("prefix"), SweepConfig("naive")]
    return [c for c in configs if c.mode == "full" or c.mode in modes]


@dataclass
class ConfigResult:
    """Per-configuration tallies: correct/total per kind, agreement with full, drift sums."""

    correct: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    agree_with_full: int = 0
    rel_l2: list[float] = field(default_factory=list)  # summed per linear layer
    angle_deg: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def add_drift(self, drift: list[tuple[float, float]]) -> None:
        if not self.rel_l2:
            self.rel_l2, self.angle_deg = [0.0] * len(drift), [0.0] * len(drift)
        for i, (rel, angle) in enumerate(drift):
            self.rel_l2[i] += rel
            self.angle_deg[i] += angle

    def summary(self) -> dict[str, Any]:
        count = sum(self.total.values())
        accuracy = {k: self.correct[k] / self.total[k] if self.total[k] else None for k in KINDS}
        return {
            "accuracy": {**accuracy, "overall": sum(self.correct.values()) / count if count else None},
            "correct": dict(self.correct), "total": dict(self.total),
            "agreement_with_full": self.agree_with_full / count if count else None,
            "drift_rel_l2": [v / count for v in self.rel_l2] if count else [],
            "drift_angle_deg": [v / count for v in self.angle_deg] if count else [],
            "seconds": round(self.seconds, 2),
        }


def select_examples(examples: Sequence[dict], limit: int | None) -> list[dict]:
    """The first ``limit`` examples of each kind, in file order (all when ``limit`` is None)."""
    taken = dict.fromkeys(KINDS, 0)
    chosen = []
    for example in examples:
        if limit is None or taken[example["kind"]] < limit:
            taken[example["kind"]] += 1
            chosen.append(example)
    return chosen


def answer_greedily(engine: Engine, prompt: str, mode: str,
                    max_new_tokens: int) -> tuple[str, list[torch.Tensor]]:
    """(greedy answer text, final recurrent state of every linear layer after the prefill)."""
    prefill = engine.prefill(engine.parse(prompt), mode)
    states = [layer.recurrent.clone() for layer in prefill.state.layers if isinstance(layer, LinearLayerState)]
    logits, state, output = prefill.logits, prefill.state, []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        if token in engine.eos_token_ids:
            break
        output.append(token)
        if len(output) < max_new_tokens:
            logits, state = engine.decode_step(state, token)
    return engine.tokenizer.decode(output), states


def run_sweep(base: Engine, examples: Sequence[dict], configs: Sequence[SweepConfig],
              max_new_tokens: int = 12, progress: bool = True) -> dict[str, Any]:
    """Answer every example in every configuration (fresh caches per example and configuration)."""
    from tqdm import tqdm

    results = {config.label: ConfigResult() for config in configs}
    predictions = []
    bar = tqdm(examples, desc="sweep", disable=not progress, file=sys.stderr)
    for example in bar:
        prompt = build_prompt(example, base.pic_separator)
        answers, reference = {}, None
        for config in configs:
            engine = Engine(base.model, base.tokenizer, base.fingerprint, seam_width=config.seam_width,
                            pic_separator=base.pic_separator, state_cache_dtype=config.state_cache_dtype)
            start = time.perf_counter()
            text, states = answer_greedily(engine, prompt, config.mode, max_new_tokens)
            result = results[config.label]
            result.seconds += time.perf_counter() - start
            answers[config.label] = text
            if reference is None:
                reference, full_text = states, text  # the first configuration is full recompute
            result.add_drift(state_drift(states, reference))
            result.correct[example["kind"]] += exact_match(text, example["answer"])
            result.total[example["kind"]] += 1
            result.agree_with_full += exact_match(text, full_text)
        predictions.append({"id": example["id"], "kind": example["kind"], "answer": example["answer"],
                            "predictions": answers})
        full = results[configs[0].label]
        bar.set_postfix(full=f"{sum(full.correct.values()) / sum(full.total.values()):.2f}")
    return {"configs": {label: r.summary() for label, r in results.items()}, "predictions": predictions}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _small(value: float) -> str:
    """3 significant digits, so that drift at rounding-error level does not print as 0."""
    return f"{value:.3g}"


def format_tables(summary: dict[str, Any], linear_layers: Sequence[int]) -> str:
    """Markdown: accuracy table (with deepest-layer drift), then drift per linear layer."""
    configs = summary["configs"]
    totals = next(iter(configs.values()))["total"]
    deepest = f"layer {linear_layers[-1]}" if linear_layers else "-"
    lines = [f"| config | single-hop % (n={totals['single_hop']}) | multi-hop % (n={totals['multi_hop']}) "
             f"| overall % | agree w/ full % | drift rel L2 % ({deepest}) | drift angle deg ({deepest}) | s/example |",
             "|---|---|---|---|---|---|---|---|"]
    count = max(1, sum(totals.values()))
    for label, result in configs.items():
        acc, rel, angle = result["accuracy"], result["drift_rel_l2"], result["drift_angle_deg"]
        drift = f"{_small(100 * rel[-1])} | {_small(angle[-1])}" if rel else "- | -"
        lines.append(f"| {label} | {_pct(acc['single_hop'])} | {_pct(acc['multi_hop'])} | {_pct(acc['overall'])} "
                     f"| {_pct(result['agreement_with_full'])} | {drift} | {result['seconds'] / count:.2f} |")
    header = " | ".join(f"layer {i} rel L2 % / angle deg" for i in linear_layers)
    lines += ["", "Final recurrent-state drift vs full, mean over examples, per linear layer:", "",
              f"| config | {header} |", "|---|" + "---|" * len(linear_layers)]
    for label, result in configs.items():
        cells = " | ".join(f"{_small(100 * r)} / {_small(a)}"
                           for r, a in zip(result["drift_rel_l2"], result["drift_angle_deg"]))
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Exact-match accuracy (single-hop / multi-hop) of full, hypic (per seam width), prefix and "
                    "naive prefill on the synthetic QA split, plus the per-layer recurrent-state drift vs full.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="default",
                        help="checkpoint directory, or 'default' for the model shipped in the package")
    parser.add_argument("--data", type=Path, default=Path("datasets/synthetic_qa"),
                        help="dataset directory written by python -m hypic_data.synthetic_qa")
    parser.add_argument("--split", default="test", choices=("train", "validation", "test"))
    parser.add_argument("--limit", type=int, default=None,
                        help="use the first N single-hop and the first N multi-hop examples (default: all)")
    parser.add_argument("--widths", type=int, nargs="+", default=[0, 4, 8, 16], help="hypic seam widths w")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="configurations to run (full, the reference, always runs)")
    parser.add_argument("--state-cache-dtypes", nargs="+", default=["float32"], choices=("float32", "bfloat16", "float16"),
                        help="precisions of the public pool's T_C and S_C|0, one hypic configuration per width and dtype")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: PyTorch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write the summary and all predictions here")
    parser.add_argument("--markdown", type=Path, default=None, help="write the printed tables here")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    base = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    examples = select_examples(read_jsonl(args.data / f"{args.split}.jsonl"), args.limit)
    start = time.perf_counter()
    configs = sweep_configs(args.widths, args.modes, args.state_cache_dtypes)
    summary = run_sweep(base, examples, configs, args.max_new_tokens, not args.no_progress)
    summary.update(model=str(args.model), split=args.split, limit=args.limit, threads=args.threads,
                   wall_s=round(time.perf_counter() - start, 1))
    tables = format_tables(summary, list(base.model.config.linear_layers()))
    header = (f"Accuracy sweep: model {args.model}, split {args.split}, {len(examples)} examples, greedy, "
              f"{args.threads} thread(s), {summary['wall_s']} s.\n\n")
    print(header + tables)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(header + tables + "\n", encoding="utf-8")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


if __name__ == "__main__":
    main()
