"""The studies: run every (sample, method) not yet recorded, summarise per dataset and method, draw.

``pareto``: accuracy against p50 TTFT for each method (paper Fig. 10). ``seam``: accuracy and TTFT
against the seam width w (Fig. 13); full recompute is the reference line. Full recompute always
runs first on each sample: the other methods' agreement with its greedy output (the first token
where they part) is part of every record.
"""
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hypic.cache.modes import Mode

from .data import Sample
from .methods import Method, MethodError
from .metrics import METRICS, first_divergence
from .results import ResultLog
from .targets import Target

FULL = Method(Mode.FULL)
LOG_TICK_LADDER = ((1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 5), (1, 3), (1,))  # mantissas per decade, densest first


def planned_methods(target: Target, methods: Sequence[Method]) -> list[Method]:
    """``methods`` without repeats, full recompute first where the target runs it (the reference of
    agreement); a method the target cannot run is an error before anything runs."""
    for method in methods:
        if not target.can_run(method):
            raise MethodError(f"this target cannot run {method.label} (a server runs the mode it was started with)")
    ordered = [FULL, *methods] if target.can_run(FULL) else list(methods)
    return [m for i, m in enumerate(ordered) if m not in ordered[:i]]


def run_study(target: Target, samples: Sequence[Sample], methods: Sequence[Method], warm: bool, results: ResultLog,
              progress: bool = True) -> list[dict[str, Any]]:
    """Every (sample, method) record, computing only those ``results`` lacks."""
    from tqdm import tqdm
    jobs = [(sample, method) for sample in samples for method in planned_methods(target, methods)]
    records = []
    for sample, method in tqdm(jobs, desc="eval", unit="request", disable=not progress, file=sys.stderr):
        record = results.get((sample.dataset, sample.id, method.label))
        if record is None:
            record = _record(target, sample, method, warm, results.get((sample.dataset, sample.id, FULL.label)))
            results.add(record)
        records.append(record)
    return records


def _record(target: Target, sample: Sample, method: Method, warm: bool, full: dict[str, Any] | None) -> dict[str, Any]:
    result = target.run(sample, method, warm)
    divergence = first_divergence(result.output_ids, full["output_ids"]) if full is not None else None
    return {"dataset": sample.dataset, "sample": sample.id, "method": method.label, "mode": method.mode,
            "seam_width": method.seam_width if method.mode == "hypic" else None,
            "state_cache_dtype": method.state_cache_dtype if method.mode == "hypic" else None, "warm": warm,
            "prediction": result.text, "output_ids": result.output_ids, "answers": list(sample.answers),
            "metric": sample.metric, "score": METRICS[sample.metric](result.text, sample.answers),
            "ttft_s": result.ttft_s, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
            "recomputed_tokens": result.recomputed_tokens, "segments_hit": result.segments_hit,
            "agrees_with_full": True if method == FULL else None if full is None else divergence is None,
            "first_divergent_token": divergence,
            **{f"meta_{k}": v for k, v in sample.meta.items()}}


def by_dataset_and_method(records: Sequence[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records grouped by (dataset, method label), in first-seen order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["dataset"], record["method"]), []).append(record)
    return groups


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dataset and method: samples, mean score (percent), TTFT p50 / p90 (ms), agreement with full (%)."""
    rows = []
    for (dataset, method), group in by_dataset_and_method(records).items():
        ttft = np.array([r["ttft_s"] for r in group]) * 1e3
        rows.append({"dataset": dataset, "method": method, "seam_width": group[0]["seam_width"], "n": len(group),
                     "metric": group[0]["metric"], "score": 100 * float(np.mean([r["score"] for r in group])),
                     "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p90_ms": float(np.percentile(ttft, 90)),
                     "agree_pct": _agreement(group),
                     "recomputed_tokens": float(np.mean([r["recomputed_tokens"] for r in group]))})
    return rows


def _agreement(group: Sequence[dict[str, Any]]) -> float | None:
    """Percent of records equal to full's greedy output; None where no full reference ran."""
    known = [r["agrees_with_full"] for r in group if r["agrees_with_full"] is not None]
    return 100 * float(np.mean(known)) if known else None


def format_summary(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of ``summarize``'s rows."""
    lines = ["| dataset | method | n | metric | score | TTFT p50 ms | TTFT p90 ms | agree w/ full % | recomputed tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dataset']} | {r['method']} | {r['n']} | {r['metric']} | {r['score']:.1f} | "
                     f"{r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | "
                     f"{'-' if r['agree_pct'] is None else format(r['agree_pct'], '.1f')} | "
                     f"{r['recomputed_tokens']:.0f} |")
    return "\n".join(lines)


def pyplot():
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    return plt


def log_tick_values(low: float, high: float, most: int = 6) -> list[float]:
    """Ticks of a log axis in [low, high]: the densest of 1-9, 1-2-5, 1-3 or 1 per decade with at most
    ``most`` in range, else every k-th power of ten. Empty if none of them falls in a narrow range."""
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    for mantissas in LOG_TICK_LADDER:
        ticks = [float(f"{m}e{e}") for e in range(first, last + 1) for m in mantissas]
        inside = [t for t in ticks if low <= t <= high]
        if len(inside) <= most:
            return inside
    stride = math.ceil((last - first + 1) / most)
    return [float(f"1e{e}") for e in range(first, last + 1) if e % stride == 0 and low <= float(f"1e{e}") <= high]


def _few_log_ticks(most: int) -> Any:
    """A log locator placing ``log_tick_values``' ticks, or evenly spaced round ones where fewer than
    two of those fall in a narrow view; it keeps ``LogLocator``'s handling of empty and non-positive
    limits."""
    from matplotlib.ticker import LogLocator, MaxNLocator

    class FewLogTicks(LogLocator):
        def tick_values(self, vmin: float, vmax: float) -> Any:
            low, high = sorted((vmin, vmax))
            if low <= 0:
                return super().tick_values(vmin, vmax)
            ticks = log_tick_values(low, high, most)
            if len(ticks) >= 2:
                return ticks
            even = MaxNLocator(nbins=min(most, 4), steps=[1, 2, 2.5, 5, 10]).tick_values(low, high)
            return [t for t in even if low <= t <= high]

    return FewLogTicks()


def plain_log_ticks(axis: Any, most: int = 6) -> None:
    """At most ``most`` tick labels on a log-scaled ``axis``, as plain numbers (0.5, 2, 10), not powers
    of ten; minor ticks unlabelled (their labels collide with each other and the major ones). Call it
    after setting the scale, which resets the ticks."""
    from matplotlib.ticker import FuncFormatter, NullFormatter
    axis.set_major_locator(_few_log_ticks(most))
    axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.set_minor_formatter(NullFormatter())


def save_figure(figure: Any, path: Path) -> None:
    """Write ``figure`` as a PNG and free it."""
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot().close(figure)


def draw_pareto(rows: Sequence[dict[str, Any]]) -> Any:
    """The figure of score against p50 TTFT (log scale, few plain tick labels), one point per method
    and dataset."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4.5))
    for marker, dataset in zip("osD^v<>p", sorted({r["dataset"] for r in rows})):
        for r in (r for r in rows if r["dataset"] == dataset):
            axes.scatter(r["ttft_p50_ms"], r["score"], marker=marker, s=50, label=f"{r['method']} ({dataset})")
    axes.set_xscale("log")
    plain_log_ticks(axes.xaxis)
    axes.set(xlabel="TTFT p50 (ms, log scale)", ylabel="score (%)", title="accuracy vs TTFT per method")
    axes.legend(fontsize=8)
    return figure


def pareto_figure(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """``draw_pareto``'s figure, written to ``path``."""
    save_figure(draw_pareto(rows), path)


def seam_figure(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Score and p50 TTFT against the seam width; full recompute as a dashed line."""
    plt = pyplot()
    figure, (score, ttft) = plt.subplots(1, 2, figsize=(9, 3.8))
    for dataset in sorted({r["dataset"] for r in rows}):
        mine = [r for r in rows if r["dataset"] == dataset]
        hypic = sorted((r for r in mine if r["seam_width"] is not None), key=lambda r: r["seam_width"])
        widths = [r["seam_width"] for r in hypic]
        score.plot(widths, [r["score"] for r in hypic], marker="o", label=f"hypic ({dataset})")
        ttft.plot(widths, [r["ttft_p50_ms"] for r in hypic], marker="o", label=f"hypic ({dataset})")
        for r in (r for r in mine if r["method"] == "full"):
            score.axhline(r["score"], linestyle="--", color="gray", label=f"full ({dataset})")
            ttft.axhline(r["ttft_p50_ms"], linestyle="--", color="gray", label=f"full ({dataset})")
    score.set(xlabel="seam width w", ylabel="score (%)")
    ttft.set(xlabel="seam width w", ylabel="TTFT p50 (ms)")
    score.legend(fontsize=8)
    save_figure(figure, path)


FIGURES = {"pareto": pareto_figure, "seam": seam_figure}
