"""The ``drift`` study (paper Table 4): how far each method's final recurrent state of every linear
layer is from full recompute's, as relative L2 error and angle, right after the prompt's prefill.
It needs the states, so it runs on the in-process engine only."""
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hypic import Engine
from hypic.state import LinearLayerState
from hypic.cache.modes import Mode

from .data import Sample
from .methods import Method, fresh_engine
from .metrics import state_drift
from .results import ResultLog
from .studies import pyplot, by_dataset_and_method, save_figure


def final_states(base: Engine, sample: Sample, method: Method, warm: bool) -> list[torch.Tensor]:
    """The recurrent state of every linear layer after ``method``'s prefill of the sample (fresh pools)."""
    engine = fresh_engine(base, sample, method, warm)
    prefill = engine.prefill(engine.parse(sample.prompt(engine.pic_separator)), method.mode)
    return [layer.recurrent for layer in prefill.state.layers if isinstance(layer, LinearLayerState)]


def run_drift(base: Engine, samples: Sequence[Sample], methods: Sequence[Method], warm: bool, results: ResultLog,
              progress: bool = True) -> list[dict[str, Any]]:
    """One record per sample and method: per linear layer, relative L2 error and angle against full."""
    from tqdm import tqdm
    layers = base.model.config.linear_layers()
    records = []
    for sample in tqdm(samples, desc="drift", unit="sample", disable=not progress, file=sys.stderr):
        missing = [m for m in methods if results.get((sample.dataset, sample.id, m.label)) is None]
        reference = final_states(base, sample, Method(Mode.FULL), warm) if missing else []
        for method in methods:
            if method in missing:
                drift = state_drift(final_states(base, sample, method, warm), reference)
                results.add({"dataset": sample.dataset, "sample": sample.id, "method": method.label,
                             "layers": layers, "rel_l2": [d[0] for d in drift], "angle_deg": [d[1] for d in drift]})
            records.append(results.get((sample.dataset, sample.id, method.label)))
    return records


def summarize_drift(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per dataset and method: the mean relative L2 error (%) and angle (degrees) at every linear layer."""
    return [{"dataset": dataset, "method": method, "n": len(group), "layers": group[0]["layers"],
             "rel_l2_pct": (100 * np.mean([r["rel_l2"] for r in group], axis=0)).tolist(),
             "angle_deg": np.mean([r["angle_deg"] for r in group], axis=0).tolist()}
            for (dataset, method), group in by_dataset_and_method(records).items()]


def format_drift(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per method, ``rel L2 % / angle deg`` per linear layer."""
    layers = rows[0]["layers"] if rows else []
    lines = ["| dataset | method | n | " + " | ".join(f"layer {i}" for i in layers) + " |",
             "|---|---|---|" + "---|" * len(layers)]
    for r in rows:
        cells = " | ".join(f"{rel:.3g} / {angle:.3g}" for rel, angle in zip(r["rel_l2_pct"], r["angle_deg"]))
        lines.append(f"| {r['dataset']} | {r['method']} | {r['n']} | {cells} |")
    return "\n".join(lines) + "\n(relative L2 error % / angle in degrees of the final recurrent state against full)"


def drift_figure(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Relative L2 error (%, log scale) against the linear layer, one line per method."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        axes.plot(r["layers"], [max(v, 1e-6) for v in r["rel_l2_pct"]], marker="o", label=f"{r['method']} ({r['dataset']})")
    axes.set_yscale("log")
    axes.set(xlabel="linear layer", ylabel="relative L2 error of the state (%)", title="state drift against full")
    axes.legend(fontsize=8)
    save_figure(figure, path)
