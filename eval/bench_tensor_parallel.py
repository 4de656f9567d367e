"""Tensor parallelism on the CPU: cold prefill and batched decode tokens/s, TP=2 against TP=1.

A random-weight model with Qwen3.5-35B-A3B's layer shapes (hidden 2048; Gated DeltaNet with 16 key
/ 32 value heads of 128; gated attention with 16 query / 2 KV heads of 256; experts of 512, top 8,
a shared expert of 512), scaled down to fit a small machine: ``--layers`` layers (one in four
attention), ``--experts`` experts, a ``--vocab`` vocabulary. fp32. TP=1 runs in one process with
one torch thread; TP=2 in two processes of one thread each, each pinned to its own core where the
OS allows. Both are measured in the same run, alternating, each after a warm-up:

- prefill: one cold ``--prompt-tokens``-token prompt (mode full: nothing reused), tokens / s;
- decode: ``--batch`` requests decoding together, ``--steps`` steps, new tokens / s.

Medians of ``--repeats``. Prints the table and the ratios, and writes every run's times as JSON.

    python eval/bench_tensor_parallel.py --json eval/results/tensor_parallel/cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_real_shapes import QWEN35_35B_A3B, _initialise  # noqa: E402

from hypic import Engine  # noqa: E402
from hypic.cache.prefix_cache import PrefixCache  # noqa: E402
from hypic.loading.checkpoints import byte_level_tokenizer  # noqa: E402
from hypic.decode import decode_batch  # noqa: E402
from hypic.models import HybridModel  # noqa: E402
from hypic.models.arch import parse_config  # noqa: E402
from hypic.parallel import TensorParallel  # noqa: E402
from hypic.parallel.launch import run_ranks  # noqa: E402
from hypic.parallel.sharding import rank_config  # noqa: E402
from hypic.tokenizer import TextTokenizer  # noqa: E402


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args()


def fields(args: argparse.Namespace) -> dict[str, Any]:
    return {**QWEN35_35B_A3B, "num_hidden_layers": args.layers, "num_experts": args.experts,
            "vocab_size": args.vocab}


def _engine(tp: TensorParallel, args: argparse.Namespace) -> Engine:
    """The rank's share of the random model (seeded per rank: the weights' values do not change the work)."""
    config = rank_config(parse_config(fields(args)), tp)
    with torch.device("meta"):
        model = HybridModel(config)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(tp.rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _initialise(name, param, generator)
    model = model.to_device("cpu", torch.float32).eval().requires_grad_(False)
    return Engine(model, TextTokenizer(byte_level_tokenizer()), f"random-tp{tp.rank}", prefix_cache=PrefixCache(0))


def _pin(tp: TensorParallel) -> None:
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= tp.size:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[tp.rank]})


def measure(tp: TensorParallel, args: argparse.Namespace) -> dict[str, list[float]]:
    """This rank's prefill and decode seconds, one per repeat (the first of each, a warm-up, dropped)."""
    _pin(tp)
    torch.set_num_threads(1)
    engine = _engine(tp, args)
    prompt = [int(t) for t in torch.randint(0, 256, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))]
    times: dict[str, list[float]] = {"prefill_s": [], "decode_s": []}
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        engine.prefill(engine.parse(prompt), "full")
        times["prefill_s"].append(time.perf_counter() - start)
        states = [engine.prefill(engine.parse(prompt[: 32 + i]), "full").state for i in range(args.batch)]
        tokens = [1] * args.batch
        start = time.perf_counter()
        for _ in range(args.steps):
            _, states = decode_batch(engine.model, states, tokens)
        times["decode_s"].append(time.perf_counter() - start)
    return {name: values[1:] for name, values in times.items()}


def cpu_name() -> str:
    """The CPU's model name and whether it has AVX-512 (the ISA the numbers were measured on)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor())
    return f"{name} ({platform.machine()}{', AVX-512' if 'avx512f' in info else ''})"


def main() -> None:
    args = _args()
    runs: dict[str, list[dict[str, list[float]]]] = {"tp1": [], "tp2": []}
    for _ in range(2):  # alternate, so that a drift in the machine's speed hits both
        runs["tp1"].append(run_ranks(measure, 1, args)[0])
        runs["tp2"].append(run_ranks(measure, 2, args)[0])
    medians = {name: {kind: statistics.median(v for run in got for v in run[kind]) for kind in ("prefill_s", "decode_s")}
               for name, got in runs.items()}
    rates = {name: {"prefill_tok_s": args.prompt_tokens / m["prefill_s"],
                    "decode_tok_s": args.batch * args.steps / m["decode_s"]} for name, m in medians.items()}
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("| | prefill tok/s | decode tok/s |\n|---|---:|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate['prefill_tok_s']:.1f} | {rate['decode_tok_s']:.1f} |")
    ratios = {kind: rates["tp2"][kind] / rates["tp1"][kind] for kind in ("prefill_tok_s", "decode_tok_s")}
    print(f"TP=2 / TP=1: prefill {ratios['prefill_tok_s']:.2f}x, decode {ratios['decode_tok_s']:.2f}x")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"options": vars(args) | {"json": str(args.json)}, "runs": runs,
                                         "rates": rates, "ratios": ratios, "cpu": cpu_name(),
                                         "torch": torch.__version__}, indent=2))


if __name__ == "__main__":
    main()
