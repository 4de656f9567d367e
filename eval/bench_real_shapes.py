"""HYPIC vs full recompute TTFT at a real model's layer shapes (paper Fig. 12, on a GPU).

The paper measures Qwen3.5-35B-A3B on an H20: full recompute 0.141 s -> 0.624 s from 4 x 1k to
4 x 4k tokens, HYPIC 0.103 s -> 0.127 s; +2.3 ms per extra hit document against +40.7 ms. This
script builds a model with that checkpoint's shapes (hidden 2048, 40 layers: 30 Gated DeltaNet
with 16 key / 32 value heads of 128, 10 gated attention with 16 query / 2 KV heads of 256; 256
experts of 512, top 8, a shared expert of 512; vocabulary 248320) directly on the device with
random weights (nothing is written to disk or downloaded), then runs the sweeps of
``hypic eval scaling`` on it: every document is cached first, then the TTFT of ``hypic`` and
``full`` on the same prompt, median of ``--repeats`` after a warm-up. The paper's numbers are
printed beside ours. ``--layers`` keeps fewer layers (one in four stays attention) where memory
forces it: the model is ~67 GB in bfloat16, so an 80 GB card holds all 40.

``--profile DIR`` also writes where one hypic request's time goes (torch.profiler: top CUDA
kernels and top CPU ops, and the share of the wall time the GPU was busy) for the longest
prompt of each sweep; with ``--profile-only NxTOKENS`` it profiles that one all-hit request (after a
warm-up) and exits: the top 15 ops by device and by host time, and the time under each labelled
part of the combine pass (``PARTS``: seam runs, composition, arena reads, re-rotation, attention, MoE).
``--json`` is rewritten after every shape, so a run cut short keeps what it measured.

Examples::

    python eval/bench_real_shapes.py --device cuda --json eval/results/bench_real_shapes.json
    python eval/bench_real_shapes.py --device cuda --profile-only 16x1024 --profile eval/results/profile
    python eval/bench_real_shapes.py --preset tiny-moe --device cpu --quick   # a smoke run anywhere
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.autograd import DeviceType

from hypic import Engine
from hypic.loading.checkpoints import byte_level_tokenizer
from hypic.models.arch import parse_config
from hypic.evaluation import scaling as composition  # the Fig. 12 sweeps and their tables
from hypic.models import HybridModel
from hypic.cache.prefix_cache import PrefixCache
from hypic.tokenizer import TextTokenizer

QWEN35_35B_A3B: dict[str, Any] = dict(
    model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
    full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False, rms_norm_eps=1e-6, eos_token_id=256,
)
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-35b-a3b": QWEN35_35B_A3B,
    "tiny-moe": dict(QWEN35_35B_A3B, vocab_size=320, hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
                     head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                     linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                     shared_expert_intermediate_size=64),
}
PAPER = {  # Fig. 12 on Qwen3.5-35B-A3B, one H20: TTFT seconds and per-document slopes
    "4x1k": {"full_s": 0.141, "hypic_s": 0.103}, "4x4k": {"full_s": 0.624, "hypic_s": 0.127},
    "16x1k": {"speedup": 4.80}, "slopes_ms_per_doc": {"full": 40.7, "hypic": 2.3},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="bench_real_shapes.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Full recompute vs HYPIC TTFT on a random-weights model with a real checkpoint's layer shapes "
                    "(paper Fig. 12: 4 x {1k,2k,4k} and {4,8,16} x 1k, every document a cache hit).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.5-35b-a3b", help="layer shapes")
    parser.add_argument("--layers", type=int, default=None, help="keep this many layers (default: the preset's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per mode and shape (median reported)")
    parser.add_argument("--quick", action="store_true", help="per-document lengths divided by 4")
    parser.add_argument("--doc-lengths", type=int, nargs="+", default=None, help="sweep (a) tokens per document")
    parser.add_argument("--doc-counts", type=int, nargs="+", default=None, help="sweep (b) document counts")
    parser.add_argument("--seam-width", type=int, default=8, help="HYPIC seam width w")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="write a torch.profiler breakdown of one hypic request per sweep's longest prompt")
    parser.add_argument("--profile-only", default=None, metavar="NxTOKENS",
                        help="only profile one all-hit hypic request of this shape (e.g. 16x1024) into --profile "
                             "and exit, before any sweep (so a slow sweep cannot cost the profile)")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.profile_only is not None and args.profile is None:
        parser.error("--profile-only needs --profile DIR")
    args.threads, args.fixed_count, args.fixed_length = 0, None, None  # what the scaling sweeps read
    return args


def _initialise(name: str, param: torch.Tensor, generator: torch.Generator, a_low: float = 1.0) -> None:
    """Weights N(0, 0.02); norms at their identity; decays A ~ U(a_low, 16) (transformers' Qwen3-Next
    and Qwen3.5 draw from 0.01; 1, this benchmark's choice, leaves out the slowest heads)."""
    if name.endswith("A_log"):
        param.copy_(torch.empty(param.shape, device=param.device).uniform_(a_low, 16, generator=generator).log())
    elif name.endswith("dt_bias") or name.endswith("mixer.norm.weight"):
        param.fill_(1.0)
    elif name.endswith("norm.weight"):
        param.zero_()  # zero-centred RMSNorm: weight 0 is the identity
    else:
        param.normal_(0.0, 0.02, generator=generator)


def random_model(fields: dict[str, Any], device: str, dtype: torch.dtype, seed: int) -> HybridModel:
    """A model of ``fields``' shapes allocated once on ``device`` and filled with seeded random weights."""
    config = parse_config(fields)
    with torch.device("meta"):
        model = HybridModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            _initialise(name, param, generator)
    return model.to_device(device, dtype).eval().requires_grad_(False)


def make_engine(args: argparse.Namespace) -> Engine:
    """The random model behind an engine with the byte-level tokenizer and no private pool (a
    repeated prompt would otherwise resume from the prefix cache, which is not composition)."""
    fields = dict(PRESETS[args.preset])
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    model = random_model(fields, args.device, getattr(torch, args.dtype), args.seed)
    return Engine(model, TextTokenizer(byte_level_tokenizer()), f"random-{args.preset}-{args.seed}",
                  seam_width=args.seam_width, prefix_cache=PrefixCache(0))


# Where a hypic request's time goes, by part: each function below runs under a profiler range of
# its label (patched in for the profile only). Ranges nest (arena reads inside composition), so
# the parts' times are inclusive, not a partition.
PARTS: tuple[tuple[str, str, str], ...] = (
    ("hypic.runs_together", "convolved", "seam runs: conv"),
    ("hypic.runs_together", "run_maps", "seam runs: maps varlen call"),
    ("hypic.runs_together", "family_varlen", "seam runs: FLA varlen calls (maps and final)"),  # both call it
    ("hypic.runs_together", "chained_recurrence", "seam runs: chunk maps, chain and outputs"),
    ("hypic.assembler", "_linear_runs", "seam runs: per-request path"),
    ("hypic.runs_together", "chain_states", "composition (state chain)"),
    ("hypic.runs_together", "splice_maps", "arena reads: T and S|0"),
    ("hypic.assembler", "_rerotated_interiors", "re-rotation (with arena reads of K/V)"),
    ("hypic.state:AttentionLayerState", "place", "KV writes into the request buffer"),
    ("hypic.models.attention:GatedAttention", "attend", "attention"),
    ("hypic.models.mlp:SparseMoE", "forward", "MoE"),
)
LAUNCH_OPS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def _owner(path: str) -> Any:
    """``module`` or ``module:Class`` -> the object whose attribute is patched."""
    module, _, cls = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, cls) if cls else owner


def _ranged(function: Callable, label: str) -> Callable:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(label):
            return function(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def labelled_parts() -> Iterator[None]:
    """Run ``PARTS``' functions under profiler ranges of their labels; restores them after."""
    saved = []
    for path, name, label in PARTS:
        owner = _owner(path)
        if hasattr(owner, name):  # a part this build does not have is left out
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, _ranged(getattr(owner, name), label))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def part_times(events: Any) -> dict[str, dict[str, float]]:
    """Per labelled part, inclusive: calls and host ms of its CPU-side range, kernel ms (the kernels
    launched under it, summed), and device span ms (its GPU-side range, first kernel's start to last
    one's end: idle gaps included, so spans of nested or back-to-back parts can sum past the wall)."""
    labels, parts = {label for _, _, label in PARTS}, {}
    for event in events:
        if event.name in labels:
            part = parts.setdefault(event.name, {"calls": 0, "host_ms": 0.0, "kernel_ms": 0.0, "device_span_ms": 0.0})
            if _on_device(event):  # the profiler's GPU-side copy of the range (a user annotation)
                part["device_span_ms"] += (event.time_range.end - event.time_range.start) / 1e3
            else:
                part["calls"] += 1
                part["host_ms"] += event.cpu_time_total / 1e3
                part["kernel_ms"] += event.device_time_total / 1e3
    return parts


def _on_device(event: Any) -> bool:
    return event.device_type != DeviceType.CPU


def device_activity(events: Any) -> tuple[float, float]:
    """The GPU's kernels, copies and memsets: their summed time and the union of their intervals (busy
    time), in ms. Only device events that are not user annotations count: the CPU op that launched a
    kernel carries its time too, and an annotation's span covers idle gaps."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if _on_device(e) and not getattr(e, "is_user_annotation", False))
    total = busy = 0.0
    end = float("-inf")
    for lo, hi in spans:
        total += hi - lo
        busy += max(0.0, hi - max(lo, end))
        end = max(end, hi)
    return total / 1e3, busy / 1e3


def _op_totals(averages: Any, names: tuple[str, ...]) -> dict[str, float]:
    rows = [e for e in averages if e.key in names]
    return {"calls": sum(e.count for e in rows), "host_ms": sum(e.self_cpu_time_total for e in rows) / 1e3}


def profile_request(engine: Engine, shape: composition.Shape, seed: int, out: Path) -> dict[str, Any]:
    """One profiled hypic request of ``shape`` (documents cached, one unprofiled warm-up first):
    the top 15 ops by device and by host time as text tables under ``out``, and a summary: wall
    time, the GPU's busy time, launches and syncs, and the labelled parts (``PARTS``)."""
    from torch.profiler import ProfilerActivity, profile
    documents = composition.documents_for(engine, shape, seed)
    prompt = composition.build_prompt(documents, engine.pic_separator)
    engine.warmup(documents)
    composition.check_all_hit(engine.generate(prompt, max_new_tokens=1, mode="hypic"), shape.num_docs)
    cuda = engine.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with labelled_parts(), profile(activities=activities) as prof:
        start = time.perf_counter()
        result = engine.generate(prompt, max_new_tokens=1, mode="hypic")
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    composition.check_all_hit(result, shape.num_docs)
    averages = prof.key_averages()
    kernel_ms, busy_ms = device_activity(prof.events())
    out.mkdir(parents=True, exist_ok=True)
    tables = [f"top 15 by {title}\n" + averages.table(sort_by=key, row_limit=15, max_name_column_width=70)
              for key, title in (("self_device_time_total", "self device time"),
                                 ("self_cpu_time_total", "self host (CPU) time"))]
    summary = {"shape": shape.label, "wall_ms": wall * 1e3, "device_kernel_ms": kernel_ms, "device_busy_ms": busy_ms,
               "device_busy_share": busy_ms / (wall * 1e3), "launches": _op_totals(averages, LAUNCH_OPS),
               "syncs_and_copies": _op_totals(averages, SYNC_OPS), "parts": part_times(prof.events())}
    parts = "\n".join(f"{label:<45}{p['calls']:>7}{p['host_ms']:>12.1f}{p['kernel_ms']:>12.1f}{p['device_span_ms']:>12.1f}"
                      for label, p in sorted(summary["parts"].items(), key=lambda kv: -kv[1]["host_ms"]))
    header = (f"hypic {shape.label}: wall {summary['wall_ms']:.1f} ms, device busy {busy_ms:.1f} ms "
              f"({100 * summary['device_busy_share']:.0f} %; kernels, copies and memsets), their sum {kernel_ms:.1f} ms, "
              f"launches {summary['launches']}, syncs/copies {summary['syncs_and_copies']}\n\n"
              f"{'part (inclusive; nested)':<45}{'calls':>7}{'host ms':>12}{'kernel ms':>12}{'span ms':>12}\n{parts}\n"
              "(span: the part's range on the GPU timeline, idle gaps included; tables below: an annotation's "
              "'Self CUDA' is its span too)")
    (out / f"profile_{shape.label}.txt").write_text(header + "\n\n" + "\n\n".join(tables) + "\n")
    (out / f"profile_{shape.label}.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def paper_lines(results: list[composition.ShapeResult], slopes: dict[str, float | None]) -> list[str]:
    """Our numbers beside the paper's (Fig. 12) where it gives them."""
    lines = ["shape    ours full s  ours hypic s  speedup | paper full s  paper hypic s  paper speedup"]
    for r in results:
        paper = PAPER.get(r.label, {})
        full, hypic = paper.get("full_s"), paper.get("hypic_s")
        speedup = paper.get("speedup") or (full / hypic if full and hypic else None)
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"{r.label:<8}{r.full_ttft_ms / 1e3:>12.3f}{r.hypic_ttft_ms / 1e3:>14.3f}{r.speedup:>8.2f}x | "
                     f"{fmt(full, '>12.3f')}{fmt(hypic, '>15.3f')}{fmt(speedup, '>14.2f')}")
    paper_slopes = PAPER["slopes_ms_per_doc"]
    if slopes["full_ms_per_doc"] is not None:
        lines.append(f"per extra document: ours full {slopes['full_ms_per_doc']:.1f} ms, hypic "
                     f"{slopes['hypic_ms_per_doc']:.2f} ms | paper full {paper_slopes['full']} ms, hypic "
                     f"{paper_slopes['hypic']} ms")
    return lines


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def _driver() -> str | None:
    """The NVIDIA driver's version (torch does not report it), None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def environment_of(args: argparse.Namespace, engine: Engine, build_s: float) -> dict[str, Any]:
    """What the numbers were measured on: the model, the device, its driver and the library versions."""
    cuda = args.device.startswith("cuda")
    return {
        "preset": args.preset, "layers": engine.model.config.num_hidden_layers,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "device": torch.cuda.get_device_name() if cuda else args.device, "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "triton": _version("triton"), "fla": _version("fla"),
        "transformers": _version("transformers"), "dtype": args.dtype, "seam_width": args.seam_width,
        "repeats": args.repeats, "warmups_per_mode": 1, "model_build_s": build_s,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def _write_json(path: Path | None, outcome: dict[str, Any]) -> None:
    """Rewritten after every shape, so a run stopped by a time limit leaves what it measured."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(outcome, indent=2, default=str) + "\n")


def _profile_shape(text: str) -> composition.Shape:
    count, _, tokens = text.lower().partition("x")
    return composition.Shape(int(count), int(tokens), ("b",))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Build the model, run the sweeps (and the profile), print both tables; returns the results."""
    args = parse_args(argv)
    start = time.perf_counter()
    engine = make_engine(args)
    build_s = time.perf_counter() - start
    if args.profile_only is not None:
        summary = profile_request(engine, _profile_shape(args.profile_only), args.seed, args.profile)
        summary["environment"] = environment_of(args, engine, build_s)
        (args.profile / f"profile_{summary['shape']}.json").write_text(json.dumps(summary, indent=2) + "\n")
        print((args.profile / f"profile_{summary['shape']}.txt").read_text())
        return summary
    shapes = composition.build_shapes(args)
    results: list[composition.ShapeResult] = []
    outcome: dict[str, Any] = {"environment": environment_of(args, engine, build_s), "shapes": [], "paper": PAPER}
    for shape in shapes:
        results.append(composition.measure_shape(engine, shape, args.repeats, args.seed))
        r = results[-1]
        print(f"{r.label}: full {r.full_ttft_ms:.1f} ms, hypic {r.hypic_ttft_ms:.1f} ms "
              f"(hypic samples {[round(x, 1) for x in r.hypic_samples_ms]}, "
              f"full samples {[round(x, 1) for x in r.full_samples_ms]})", flush=True)
        outcome.update(shapes=[asdict(x) for x in results], environment=environment_of(args, engine, build_s),
                       wall_s=time.perf_counter() - start)
        _write_json(args.json, outcome)
    slopes = composition.document_slopes(results)
    profiles = {}
    if args.profile is not None:
        for sweep in ("a", "b"):
            longest = max((s for s in shapes if sweep in s.sweeps), key=lambda s: s.num_docs * s.doc_tokens)
            profiles[longest.label] = profile_request(engine, longest, args.seed, args.profile)
    environment = environment_of(args, engine, build_s)
    outcome.update(environment=environment, slopes=slopes, profiles=profiles, wall_s=time.perf_counter() - start)
    print(f"\n{args.preset}, {environment['layers']} layers, {environment['parameters'] / 1e9:.2f} B parameters, "
          f"{environment['device']} {args.dtype}, w={args.seam_width}, median of {args.repeats}")
    print(composition.format_table(results))
    print(composition.format_slopes(slopes))
    print("\n".join(paper_lines(results, slopes)))
    for label, numbers in profiles.items():
        print(f"profile hypic {label}: wall {numbers['wall_ms']:.1f} ms, device busy {numbers['device_busy_ms']:.1f} ms "
              f"({100 * numbers['device_busy_share']:.0f} %)")
    _write_json(args.json, outcome)
    return outcome


if __name__ == "__main__":
    main()
