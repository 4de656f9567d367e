"""How many heads of a cached document's dense T_C decay to exactly zero (stored as flags, not
matrices), and what that does to an entry's bytes, per 1k-token document.

Two models:

- ``qwen35``: Qwen3.5-35B-A3B's layer shapes (hidden 2048; Gated DeltaNet with 16 key / 32 value
  heads of 128; gated attention 16 / 2 heads of 256) with random weights, gates initialised as
  transformers initialises Qwen3-Next / Qwen3.5 (A ~ U(0.01, 16), A_log = log A, dt_bias = 1; every
  other weight N(0, 0.02)). Random-init gates are not trained gates: this says what the
  initialisation does, not what the released checkpoint does. Each seed is a 40-layer model (30
  Gated DeltaNet, 10 attention) in bfloat16 with 8 experts (top 2) and a 320-token vocabulary
  (neither shapes a linear layer's T_C or an entry; they keep the model at ~5 GB).
- ``default``: the shipped default model (trained weights), documents cut from this repository's
  docs/ (English prose) to ``--tokens`` tokens.

Per layer and head: whether T_C (fp32, as the engine stores it) is exactly zero, and the largest
|T_C| entry of the heads kept. Entry bytes: the public pool's tensor bytes and the entry file's
bytes (format /3), with every matrix stored (before) and with decayed heads flagged (after).

    python eval/measure_decayed_heads.py --out eval/results/decayed_heads
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import platform
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from hypic import Engine
from hypic.cache.composition import Transition
from hypic.cache.store import AttentionInterior, LinearInterior, SegmentEntry
from hypic.cache.tiers.entry_file import EntryIdentity, encode_entry
from hypic.loading.checkpoints import byte_level_tokenizer
from hypic.loading.default_model import DEFAULT_MODEL_DIR
from hypic.models import HybridModel
from hypic.models.arch import parse_config
from hypic.models.families import linear_shapes
from hypic.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("architecture.md", "operations.md", "families.md")


@functools.cache
def _bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_real_shapes", ROOT / "eval" / "bench_real_shapes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def qwen35_fields(layers: int) -> dict[str, Any]:
    return dict(_bench_module().QWEN35_35B_A3B, num_hidden_layers=layers, num_experts=8, num_experts_per_tok=2,
                vocab_size=320)


def _initialise(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """transformers' Qwen3-Next / Qwen3.5 init: gates A ~ U(0.01, 16), dt_bias = 1; N(0, 0.02) else."""
    _bench_module()._initialise(name, param, generator, a_low=0.01)


def random_engine(fields: dict[str, Any], seed: int) -> Engine:
    with torch.device("meta"):
        model = HybridModel(parse_config(fields))
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _initialise(name, param, generator)
    model = model.to_device("cpu", torch.bfloat16).eval().requires_grad_(False)  # the checkpoint's dtype: KV bytes as served
    return Engine(model, TextTokenizer(byte_level_tokenizer()), f"random-qwen35-{seed}")


def documents(engine: Engine, tokens: int, count: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``count`` windows of ``tokens`` tokens of docs/ prose (one per file, cycling)."""
    for index in range(count):
        name = DOCS[index % len(DOCS)]
        ids = engine.tokenizer.encode((ROOT / "docs" / name).read_text())
        start = (index // len(DOCS)) * tokens
        if start + tokens > len(ids):
            raise ValueError(f"docs/{name} has {len(ids)} tokens, fewer than {start + tokens}")
        yield f"docs/{name}[{start}:{start + tokens}]", tuple(ids[start:start + tokens])


def full_entry(engine: Engine, ids: tuple[int, ...]) -> SegmentEntry:
    """The entry with every head's matrix stored (flagging off), not kept in the pool."""
    original = Transition.without_decayed
    Transition.without_decayed = lambda self: self  # type: ignore[method-assign]
    try:
        entry = engine.segment_entry(ids, engine.policy("hypic"))[0]
    finally:
        Transition.without_decayed = original  # type: ignore[method-assign]
    engine.cache.public.clear()
    return entry


def flagged_entry(entry: SegmentEntry) -> SegmentEntry:
    layers = [LinearInterior(layer.transition.without_decayed(), layer.zero_start_state, layer.conv_tail)
              if isinstance(layer, LinearInterior) and layer.transition is not None else layer
              for layer in entry.layers]
    return SegmentEntry(entry.key, entry.token_ids, entry.seams, entry.local_start, entry.length, layers,
                        entry.namespace)


def head_rows(entry: SegmentEntry) -> list[dict[str, Any]]:
    """Per linear layer: heads, decayed heads, and log10 of each kept head's largest |T_C| entry."""
    rows = []
    for index, layer in enumerate(entry.layers):
        if isinstance(layer, LinearInterior) and layer.transition is not None:
            largest = layer.transition.value.float().abs().flatten(1).amax(1)
            rows.append({"layer": index, "heads": int(largest.numel()), "decayed": int((largest == 0).sum()),
                         "log10_max_abs_kept": [round(math.log10(v), 2) for v in largest.tolist() if v > 0]})
    return rows


def layer_bytes(entry: SegmentEntry) -> dict[str, int]:
    """Bytes of one linear layer's T_C, S_C|0 and conv tail, and of one attention layer's K and V."""
    linear = next(layer for layer in entry.layers if isinstance(layer, LinearInterior))
    attention = next(layer for layer in entry.layers if isinstance(layer, AttentionInterior))
    assert linear.transition is not None
    return {"transition": linear.transition.nbytes, "head_matrix": linear.transition.nbytes // linear.transition.shape[0],
            "linear_rest": linear.zero_start_state.nbytes + linear.conv_tail.nbytes,
            "attention": attention.keys.nbytes + attention.values.nbytes}


def measure(engine: Engine, label: str, ids: tuple[int, ...]) -> dict[str, Any]:
    started = time.perf_counter()
    full = full_entry(engine, ids)
    flagged = flagged_entry(full)
    identity = EntryIdentity(engine.fingerprint, engine.model.dtype, engine.state_cache_dtype, engine.model.config,
                             linear_shapes(engine.model.config))
    return {"document": label, "tokens": len(ids), "interior": full.length, "heads": head_rows(full),
            "memory_bytes_before": full.nbytes, "memory_bytes_after": flagged.nbytes,
            "file_bytes_before": len(encode_entry(full, identity)), "file_bytes_after": len(encode_entry(flagged, identity)),
            "layer_bytes": layer_bytes(full), "build_s": round(time.perf_counter() - started, 2)}


def totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Heads and decayed heads over every record, and the median entry's bytes before and after."""
    def median(name: str) -> int:
        return sorted(r[name] for r in records)[len(records) // 2]
    return {"documents": len(records), "heads": sum(row["heads"] for r in records for row in r["heads"]),
            "decayed": sum(row["decayed"] for r in records for row in r["heads"]),
            **{name: median(name) for name in ("memory_bytes_before", "memory_bytes_after", "file_bytes_before",
                                               "file_bytes_after")}}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def summary_line(record: dict[str, Any]) -> str:
    heads = sum(row["heads"] for row in record["heads"])
    decayed = sum(row["decayed"] for row in record["heads"])
    per_layer = " ".join(f"{row['decayed']}/{row['heads']}" for row in record["heads"])
    return (f"{record['model']:>8} {record['document']:<34} decayed {decayed:>4}/{heads:<4} per layer [{per_layer}]  "
            f"memory {record['memory_bytes_before'] / 2**20:8.2f} -> {record['memory_bytes_after'] / 2**20:8.2f} MiB  "
            f"file {record['file_bytes_before'] / 2**20:8.2f} -> {record['file_bytes_after'] / 2**20:8.2f} MiB")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=["qwen35", "default"], default=["default", "qwen35"])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    parser.add_argument("--seeds", type=int, default=3, help="random Qwen3.5-35B-A3B-shaped models")
    parser.add_argument("--layers", type=int, default=40, help="layers of each random model (one in four attention)")
    parser.add_argument("--documents", type=int, default=3, help="documents through the default model")
    parser.add_argument("--out", type=Path, default=None, help="write records.jsonl and summary.json here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    records: list[dict[str, Any]] = []
    if "default" in args.models:
        engine = Engine.from_pretrained(DEFAULT_MODEL_DIR)
        for label, ids in documents(engine, args.tokens, args.documents):
            records.append({"model": "default", **measure(engine, label, ids)})
            print(summary_line(records[-1]), flush=True)
        engine.close()
    for seed in range(args.seeds if "qwen35" in args.models else 0):
        engine = random_engine(qwen35_fields(args.layers), seed)
        label, ids = next(documents(engine, args.tokens, 1))
        records.append({"model": "qwen35", "seed": seed, **measure(engine, label, ids)})
        print(summary_line(records[-1]), flush=True)
        engine.close()
        del engine
    summary = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(), "args": {
        k: str(v) for k, v in vars(args).items()}}
    for model in ("default", "qwen35"):
        mine = [r for r in records if r["model"] == model]
        if mine:
            summary[model] = totals(mine)
            print(model, json.dumps(summary[model]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
