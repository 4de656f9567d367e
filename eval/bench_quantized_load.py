"""Loading an FP8 checkpoint (dequantized at load) against the same model's bfloat16 checkpoint.

The model has Qwen3.5-35B-A3B's layer shapes (hidden 2048; Gated DeltaNet with 16 key / 32 value
heads of 128; gated attention with 16 query / 2 KV heads of 256; experts of 512 and a shared one of
512) but only ``--layers`` layers (one in four attention), ``--experts`` experts and a
``--vocab``-token vocabulary, so that it fits beside other work: random weights written by
``transformers`` (per-expert tensors, as Qwen's FP8 releases store them). Its FP8 copy quantizes
every linear weight but those Qwen's releases keep in bfloat16 (embeddings, lm_head, router, a/b
projections) in 128 x 128 blocks; the float copy is the bfloat16 model. Both are loaded into
bfloat16 by ``hypic.loading.loader.load_model``, each load in a fresh process that first loads a tiny
checkpoint (imports, allocator set-up outside the measurement): the load's wall time and the peak
resident memory it adds (VmHWM reset just before it). One warm-up load of each (the files enter the
page cache) is dropped, then ``--runs`` loads alternate between the two; medians and their ratio
are printed and the raw runs written to ``--out``.

Run with the tests' import path (the FP8 writer is the tests' helper)::

    PYTHONPATH=.:tests/helpers python eval/bench_quantized_load.py --out eval/results/quantized_load
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hypic.loading.checkpoints import write_random_checkpoint
from hypic_testing.tiny_models import TINY_VARIANTS
from hypic_testing.quantized import write_fp8_checkpoint

SHAPES: dict[str, Any] = dict(  # Qwen3.5-35B-A3B's text config, less its depth, experts and vocabulary
    hidden_size=2048, full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    tie_word_embeddings=False)
LOAD_SCRIPT = """
import re, sys, time
from pathlib import Path
import torch
from hypic.loading.loader import load_model

def status(field):
    return int(re.search(rf"{field}:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

path, warm = Path(sys.argv[1]), Path(sys.argv[2])
load_model(warm, dtype=torch.bfloat16)
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts here
base = status("VmRSS")
start = time.perf_counter()
model = load_model(path, dtype=torch.bfloat16)
seconds = time.perf_counter() - start
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(seconds, status("VmHWM") - base, size)
"""


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--runs", type=int, default=5, help="measured loads of each checkpoint")
    parser.add_argument("--out", type=Path, default=None, help="directory for the raw runs (runs.json)")
    return parser.parse_args()


def write_checkpoints(root: Path, args: argparse.Namespace) -> dict[str, Path]:
    """The bfloat16 checkpoint and its FP8 copy."""
    source = write_random_checkpoint(root / "fp32", "qwen3_5_moe_text", 0, **SHAPES, num_hidden_layers=args.layers,
                                     num_experts=args.experts, vocab_size=args.vocab)
    bf16 = Path(shutil.copytree(source, root / "bfloat16"))
    tensors = {name: tensor.bfloat16() for name, tensor in load_file(str(source / "model.safetensors")).items()}
    save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    shutil.rmtree(source)
    return {"bfloat16": bf16, "fp8": write_fp8_checkpoint(bf16, root / "fp8", (128, 128))}


def load_once(path: Path, warm: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(path), str(warm)], capture_output=True, text=True,
                          check=True)
    seconds, peak, size = done.stdout.split()
    return {"seconds": float(seconds), "peak_added_bytes": int(peak), "model_bytes": int(size)}


def cpu_name() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16") if flag in info.split()]
    return f"{name} ({platform.machine()}, {', '.join(flags) or 'no AVX-512'})"


def measure(paths: dict[str, Path], warm: Path, runs: int) -> dict[str, list[dict[str, float]]]:
    for path in paths.values():  # warm-up: the files enter the page cache
        load_once(path, warm)
    measured: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
    for _ in range(runs):  # alternating, so that a change in the machine's load hits both
        for name, path in paths.items():
            measured[name].append(load_once(path, warm))
    return measured


def summary(measured: dict[str, list[dict[str, float]]], paths: dict[str, Path]) -> dict[str, dict[str, float]]:
    out = {}
    for name, runs in measured.items():
        out[name] = {"median_seconds": statistics.median(r["seconds"] for r in runs),
                     "min_seconds": min(r["seconds"] for r in runs),
                     "median_peak_added_bytes": statistics.median(r["peak_added_bytes"] for r in runs),
                     "model_bytes": runs[0]["model_bytes"],
                     "file_bytes": (paths[name] / "model.safetensors").stat().st_size}
    return out


def report(args: argparse.Namespace, measured: dict[str, list[dict[str, float]]], result: dict[str, dict[str, float]],
           load_before: tuple[float, float, float]) -> dict[str, Any]:
    ratio, fastest = (result["fp8"][key] / result["bfloat16"][key] for key in ("median_seconds", "min_seconds"))
    return {"cpu": cpu_name(), "torch_threads": torch.get_num_threads(), "load_average": [load_before, os.getloadavg()],
            "args": {k: str(v) for k, v in vars(args).items()}, "summary": result,
            "fp8_over_bfloat16_load_time": {"medians": ratio, "fastest_runs": fastest}, "runs": measured}


def print_report(out: dict[str, Any], runs: int) -> None:
    for name, row in out["summary"].items():
        print(f"{name:9s} load {row['median_seconds']:.2f} s (fastest {row['min_seconds']:.2f} s)  peak added "
              f"{row['median_peak_added_bytes'] / 2**20:.0f} MiB  model {row['model_bytes'] / 2**20:.0f} MiB  "
              f"file {row['file_bytes'] / 2**20:.0f} MiB")
    ratios, (before, after) = out["fp8_over_bfloat16_load_time"], out["load_average"]
    print(f"fp8 / bfloat16 load time: {ratios['medians']:.2f} (medians of {runs} runs each; fastest runs "
          f"{ratios['fastest_runs']:.2f}), {out['cpu']}, {out['torch_threads']} threads, 1-minute load average "
          f"{before[0]:.1f} before, {after[0]:.1f} after (this machine's cores are shared)")


def main() -> None:
    args, load_before = _args(), os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        paths = write_checkpoints(Path(root), args)
        model_type, overrides = TINY_VARIANTS["qwen3_5_moe_text"]
        warm = write_random_checkpoint(Path(root) / "warm", model_type, 0, **overrides)
        measured = measure(paths, warm, args.runs)
        out = report(args, measured, summary(measured, paths), load_before)
    print_report(out, args.runs)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "runs.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
