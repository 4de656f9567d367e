"""Which published hybrid models fit which GPU at which tensor-parallel size, from HYPIC's own accounting.

For each model of ``eval/published_configs/`` (the fields of its published ``config.json`` that shape
the model, each file naming its source) and each TP size N in 1, 2, 4, 8 this computes one rank's
share, using HYPIC's code paths rather than formulas of ours:

- **weights**: ``parse_config`` -> ``rank_config(config, TensorParallel(0, N))`` -> ``HybridModel`` built
  on the meta device (no memory), summing numel x 2 bytes (bfloat16: HYPIC holds an FP8 checkpoint
  dequantized, so bfloat16 is what it needs). Rank 0 is measured; every rank has the same shapes.
  An FP8 column estimates what the FP8 release would take if its quantized projections stayed at one
  byte a weight (HYPIC does not do this today; the column is for comparison only).
- **entry**: ``sizing.entry_bytes`` of a 1k-token document under the ``hypic`` mode at the engine's
  defaults (seam width 8, KV in bfloat16, T_C and S_C|0 in float32): the public-pool entry one rank holds.
- **state**: ``sizing.state_bytes`` of an 8k-token request (KV of the full-attention layers plus
  the linear layers' states): the server's admission budget for it on one rank.

A GPU "fits" a configuration when the weights plus room for ``--requests`` concurrent 8k-token
states stay within its capacity less ``--margin`` (activations, the CUDA context, the allocator's
slack). What is left over is the public pool: the number of 1k-token document entries it holds per
GPU (under TP every rank holds its shard of every document, so that is also the group's count).

    python eval/tp_fit_table.py --out eval/results/tp_fit
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from hypic import sizing
from hypic.cache.modes import mode_policy
from hypic.config import ModelConfig
from hypic.errors import UnsupportedModel
from hypic.models import HybridModel
from hypic.models.arch import parse_config
from hypic.parallel import TensorParallel
from hypic.parallel.sharding import rank_config

CONFIG_DIR = Path(__file__).resolve().parent / "published_configs"
MODELS = (  # (label, file stem under published_configs/)
    ("Qwen3.5-35B-A3B", "qwen3.5-35b-a3b"),
    ("Qwen3.5-122B-A10B", "qwen3.5-122b-a10b"),
    ("Ring-flash-linear-2.0", "ring-flash-linear-2.0"),
    ("Qwen3-Next-80B-A3B", "qwen3-next-80b-a3b"),
    ("Kimi-Linear-48B-A3B", "kimi-linear-48b-a3b"),
    ("MiniMax-Text-01", "minimax-text-01"),
)
TP_SIZES = (1, 2, 4, 8)
MIB = 1 << 20
GPUS = {"H100": 81559 * MIB, "H200": 143771 * MIB}  # memory.total as nvidia-smi reports it (80 GB and 141 GB cards)
WEIGHT_DTYPE = torch.bfloat16
UNQUANTIZED = ("embed_tokens", "lm_head", "router", "shared_expert_gate", "conv")  # kept in bf16 by FP8 releases


@dataclass(frozen=True)
class Workload:
    """The sizes the table is computed for."""

    doc_tokens: int = 1024
    request_tokens: int = 8192
    requests: int = 16
    margin: float = 0.10  # of the GPU's capacity, held back for activations and the CUDA context
    seam_width: int = 8
    state_cache_dtype: torch.dtype = torch.float32


@dataclass
class RankSizes:
    """One rank's bytes for one model at one TP size (``refused``: why HYPIC would not run it)."""

    model: str
    tp: int
    parameters: int = 0
    weight_bytes: int = 0
    fp8_weight_bytes: int | None = None
    entry_bytes: int = 0
    state_bytes: int = 0
    refused: str = ""
    fits: dict[str, bool] | None = None
    documents: dict[str, int] | None = None


def published_config(stem: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the config.json fields, the file's notes: its ``_``-prefixed keys) of one published model."""
    data = json.loads((CONFIG_DIR / f"{stem}.json").read_text())
    return ({k: v for k, v in data.items() if not k.startswith("_")},
            {k: v for k, v in data.items() if k.startswith("_")})


def meta_model(config: ModelConfig) -> HybridModel:
    """HYPIC's model of ``config`` with every parameter on the meta device (shapes only)."""
    with torch.device("meta"):
        return HybridModel(config)


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of every parameter of ``model`` held in ``dtype``."""
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


def fp8_weight_bytes(model: torch.nn.Module) -> int:
    """Estimate: projection matrices (2-D and up) at 1 byte, the embedding, LM head, router, gates,
    convolutions, norms and vectors at 2; block scales (one per 128 x 128) are left out (< 0.01%)."""
    def size(name: str, p: torch.Tensor) -> int:
        quantized = p.dim() >= 2 and not any(part in name for part in UNQUANTIZED)
        return p.numel() * (1 if quantized else 2)
    return sum(size(name, p) for name, p in model.named_parameters())


def cache_bytes(config: ModelConfig, work: Workload) -> tuple[int, int]:
    """(one 1k-token document's public-pool entry, one 8k-token request's state) on this rank."""
    policy = mode_policy("hypic", work.seam_width, config.linear_conv_kernel_dim)
    entry = sizing.entry_bytes(config, policy, work.doc_tokens, WEIGHT_DTYPE, work.state_cache_dtype)
    return entry, sizing.state_bytes(config, WEIGHT_DTYPE, work.request_tokens)


def fit(sizes: RankSizes, work: Workload) -> None:
    """Whether each GPU holds the weights, the margin and ``requests`` states, and how many
    document entries the rest holds."""
    sizes.fits, sizes.documents = {}, {}
    for gpu, capacity in GPUS.items():
        left = capacity * (1 - work.margin) - sizes.weight_bytes - work.requests * sizes.state_bytes
        sizes.fits[gpu] = left >= 0
        sizes.documents[gpu] = int(left // sizes.entry_bytes) if left >= 0 and sizes.entry_bytes else 0


def rank_sizes(label: str, config: ModelConfig, tp: int, work: Workload, fp8: bool) -> RankSizes:
    """One rank's sizes at TP size ``tp``, or the reason HYPIC refuses that split."""
    sizes = RankSizes(label, tp)
    try:
        rank = rank_config(config, TensorParallel(0, tp))
        model = meta_model(rank)
    except UnsupportedModel as refusal:
        sizes.refused = str(refusal)
        return sizes
    sizes.parameters = sum(p.numel() for p in model.parameters())
    sizes.weight_bytes = weight_bytes(model, WEIGHT_DTYPE)
    sizes.fp8_weight_bytes = fp8_weight_bytes(model) if fp8 else None
    sizes.entry_bytes, sizes.state_bytes = cache_bytes(rank, work)
    fit(sizes, work)
    return sizes


def model_rows(label: str, stem: str, work: Workload) -> list[RankSizes]:
    """Every TP size's row of one model."""
    raw, notes = published_config(stem)
    config = parse_config(raw)
    return [rank_sizes(label, config, tp, work, bool(notes.get("_fp8_release"))) for tp in TP_SIZES]


def _gib(value: float) -> str:
    return f"{value / (1 << 30):.1f}"


def _fit_cell(row: RankSizes, gpu: str) -> str:
    assert row.fits is not None and row.documents is not None
    return f"yes, {row.documents[gpu]:,} docs" if row.fits[gpu] else "no"


def markdown(rows: Sequence[RankSizes], work: Workload) -> str:
    """The table: one line per model and TP size, sizes per rank."""
    head = (f"| model | TP | weights / rank, GiB (bf16) | FP8 release, GiB (est.) | 1k-doc entry / rank, MiB "
            f"| {work.request_tokens // 1024}k state / rank, MiB | H100 (80 GB) | H200 (141 GB) |")
    lines = [head, "|" + "---|" * 8]
    for row in rows:
        if row.refused:
            lines.append(f"| {row.model} | {row.tp} | refused: {row.refused} | | | | | |")
            continue
        fp8 = _gib(row.fp8_weight_bytes) if row.fp8_weight_bytes is not None else "-"
        lines.append(f"| {row.model} | {row.tp} | {_gib(row.weight_bytes)} | {fp8} | {row.entry_bytes / MIB:.1f} "
                     f"| {row.state_bytes / MIB:.1f} | {_fit_cell(row, 'H100')} | {_fit_cell(row, 'H200')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tp_fit_table.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write table.md and results.json into this folder")
    parser.add_argument("--requests", type=int, default=Workload.requests, help="concurrent requests' states reserved")
    parser.add_argument("--margin", type=float, default=Workload.margin, help="fraction of each GPU held back")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    work = Workload(requests=args.requests, margin=args.margin)
    rows = [row for label, stem in MODELS for row in model_rows(label, stem, work)]
    table = markdown(rows, work)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(table)
        settings = {**asdict(work), "state_cache_dtype": str(work.state_cache_dtype), "weight_dtype": str(WEIGHT_DTYPE),
                    "gpu_capacity_bytes": GPUS, "tp_sizes": TP_SIZES}
        sources = {label: published_config(stem)[1] for label, stem in MODELS}
        payload = {"settings": settings, "sources": sources, "rows": [asdict(row) for row in rows]}
        (args.out / "results.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
