"""Scalability of linear-attention state composition: the paper's Fig. 12 TTFT sweeps on CPU.

HYPIC paper, section 6.3 ("Scalability of state composition"), Fig. 12:

  (a) 4 documents x {1k, 2k, 4k} tokens per document (prompts of ~4k to ~16k tokens);
  (b) {4, 8, 16} documents x 1k tokens per document.

Every prompt is ``L <<PIC_SEP>> C1 <<PIC_SEP>> ... <<PIC_SEP>> Cn <<PIC_SEP>> Q`` with a 32-token
leading instruction L and a 32-token question Q. For each shape the documents are cached first
(``Engine.warmup``), so that in ``hypic`` mode every document is a hit and only L (32 tokens),
the seams (2w tokens per document for w >= k - 1) and Q are recomputed. The private pool (prefix cache) is off:
a repeated prompt would otherwise resume at its last document boundary, which measures prefix
caching rather than composition. Then the
time to first token (TTFT) of ``hypic`` and of ``full`` recompute on the same prompt is measured,
each as the median of ``--repeats`` runs after one untimed warm-up run.

Printed: a table of shape, prompt tokens, full TTFT, hypic TTFT and speedup (full / hypic); for
sweep (b) the incremental cost of one extra document in each mode (least-squares slope of TTFT
against the document count, ms/document) and the ratio of the two slopes; and a PASS/FAIL line
per target:

  * speedup >= 10x at the 16k-token prompts (16384 document tokens: 4 x 4k and 16 x 1k);
  * hypic's cost per extra document >= 20x smaller than full recompute's, over sweep (b) as
    defined: 4, 8 and 16 documents of 1k tokens.

The targets are judged only at those sizes: a run at others (``--quick``, ``--doc-lengths`` ...)
prints "NOT JUDGED" and the size the target is defined for, since the speed-ups grow with the
prompt (a quarter-size run would fail bars set for 16k tokens, a larger one pass them too easily).

(The paper reports 4.91x at 16k tokens and 2.3 vs 40.7 ms/segment on GPUs with real models; on
CPU the quadratic full-attention prefill is relatively more expensive, hence the higher bars.)
The exit code is 0 whether or not the targets pass, unless ``--strict`` is given: then it is 1
unless every target was judged and passed.

Default model (a random ``qwen3_5_text`` checkpoint with a byte-level tokenizer, so a document of
N lowercase ASCII characters is N tokens): hidden 256, 8 layers (6 Gated DeltaNet + 2 gated full
attention, one full layer every 4), MLP 512; linear layers with 4 key heads / 8 value heads of
dim 64 and conv kernel 4; full attention with 2 query heads / 1 KV head of dim 64 (partial rotary
0.25). This is "tiny but not trivial": every mechanism HYPIC must get right (GQA in the linear
layers, conv tails, dense 64x64 transitions per value head, partial-rotary re-rotation, GQA in
attention) is present at a realistic head size, yet the whole benchmark -- dominated by the
full-recompute prefills at 16k tokens, whose attention is quadratic -- runs in well under ten
minutes on one CPU core. Two query heads (not four) keep that quadratic part within the budget.

Threads: ``--threads`` defaults to 1. On a small shared machine (2 cores used by other jobs too),
two OpenMP threads are often several times *slower* than one, because the workers spin on a
core someone else holds; one thread gives stable, reproducible timings. Pass ``--threads 0`` to
keep PyTorch's own default.

Examples::

    hypic eval scaling                  # full sweeps, ~5-10 minutes on CPU
    hypic eval scaling --quick          # per-document lengths / 4, ~1 minute
    hypic eval scaling --model DIR --json out.json --strict
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

import hypic
from hypic import DEFAULT_SEPARATOR, Engine, GenerationResult
from hypic.loading.checkpoints import write_random_checkpoint
from hypic.models.arch import architecture
from hypic.cache.modes import Mode
from hypic.cache.store import LinearInterior
from hypic.tokenizer import TextTokenizer

from .results import ResultLog

LEADING = "Answer from the documents below:"  # 32 tokens with the byte-level tokenizer
QUESTION = "Question: what do they all say?\n"  # 32 tokens with the byte-level tokenizer
SPEEDUP_TARGET = 10.0  # full / hypic TTFT at the 16k-token prompts
SLOPE_RATIO_TARGET = 20.0  # full's ms per extra document / hypic's, over sweep (b) as defined
STUDY_HIDDEN, STUDY_LAYERS = 256, 8  # the random study model's size (each architecture's shapes: its ``study``)
ARCHITECTURES = {"qwen3_5": "qwen3_5_text", "minimax": "minimax", "granite": "granitemoehybrid", "kimi": "kimi_linear",
                 "nemotron": "nemotron_h", "mimo": "mimo_v2_flash"}  # --architecture -> model type
FULL_SWEEP = dict(lengths=(1024, 2048, 4096), counts=(4, 8, 16), fixed_count=4, fixed_length=1024)
TARGET_DOC_TOKENS = 16 * 1024  # the speed-up target's prompts: their documents' tokens (4 x 4k, 16 x 1k)
SLOPE_TARGET_SHAPES = tuple((n, FULL_SWEEP["fixed_length"]) for n in FULL_SWEEP["counts"])  # (documents, tokens each)
WORD_CHARS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Shape:
    """One prompt shape: ``num_docs`` documents of ``doc_tokens`` tokens, in sweeps ``sweeps``."""

    num_docs: int
    doc_tokens: int
    sweeps: tuple[str, ...]

    @property
    def label(self) -> str:
        size = f"{self.doc_tokens // 1024}k" if self.doc_tokens % 1024 == 0 else str(self.doc_tokens)
        return f"{self.num_docs}x{size}"


@dataclass
class ShapeResult:
    """Measured TTFTs (ms) and token accounting of one shape."""

    label: str
    sweeps: list[str]
    num_docs: int
    doc_tokens: int
    prompt_tokens: int
    full_ttft_ms: float
    hypic_ttft_ms: float
    speedup: float
    segments_hit: int
    hypic_cached_tokens: int
    hypic_recomputed_tokens: int
    hypic_combine_tokens: int
    full_recomputed_tokens: int
    warmup_s: float
    transition_bytes_per_doc: int = 0  # T_C of every linear layer of one cached document
    entry_bytes_per_doc: int = 0  # the document's whole public-pool entry
    full_samples_ms: list[float] = field(default_factory=list)
    hypic_samples_ms: list[float] = field(default_factory=list)


@dataclass
class Target:
    """One pass/fail criterion; ``passed`` is None where it was not judged (the run's shapes are not
    the sizes it is defined for; ``value`` is then only informative)."""

    name: str
    value: float | None
    threshold: float
    passed: bool | None
    detail: str


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="hypic eval scaling",
        description="HYPIC vs full recompute TTFT as context length and document count grow (paper Fig. 12): "
                    "(a) 4 documents x {1k,2k,4k} tokens, (b) {4,8,16} documents x 1k tokens. Documents are "
                    "cached first, so hypic recomputes only L, the seams and the question.",
        epilog="Targets: speedup >= 10x at the 16k-token prompts (4 x 4k, 16 x 1k); hypic's cost per extra "
               "document >= 20x smaller than full recompute's over {4, 8, 16} x 1k. They are judged only at "
               "those sizes: --quick and other sizes print NOT JUDGED. Exit code 0 unless --strict and a target "
               "fails or is not judged.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", type=Path, default=None,
                        help="existing checkpoint directory (config.json, safetensors, tokenizer.json) instead of "
                             "the random default model; --hidden-size/--layers are then ignored")
    parser.add_argument("--architecture", choices=sorted(ARCHITECTURES), default="qwen3_5",
                        help="layers of the random model: qwen3_5 (Gated DeltaNet, dense T_C), minimax "
                             "(Lightning attention, scalar T_C, MoE in every layer), granite (Mamba2, scalar T_C), "
                             "kimi (Kimi Delta Attention, dense T_C; latent attention), nemotron (Mamba2 blocks "
                             "and squared-ReLU MLP blocks, scalar T_C) or mimo (MiMo-V2-Flash's sliding-window "
                             "attention, window 129, a full layer first and every 6th; no linear layers)")
    parser.add_argument("--hidden-size", type=int, default=STUDY_HIDDEN,
                        help="hidden size of the random model")
    parser.add_argument("--layers", type=int, default=STUDY_LAYERS,
                        help="layers of the random model (every 4th is full attention, the rest Gated DeltaNet)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode and shape (median reported)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: per-document lengths divided by 4 (the targets, set for 16k-token "
                             "prompts, are then not judged)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random model and the documents")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads; 0 keeps PyTorch's default (1 is steadiest on a shared machine)")
    parser.add_argument("--seam-width", type=int, default=8, help="HYPIC seam width w")
    parser.add_argument("--doc-lengths", type=int, nargs="+", default=None,
                        help="sweep (a) per-document token counts (default 1024 2048 4096)")
    parser.add_argument("--doc-counts", type=int, nargs="+", default=None,
                        help="sweep (b) document counts (default 4 8 16)")
    parser.add_argument("--fixed-count", type=int, default=None, help="document count of sweep (a) (default 4)")
    parser.add_argument("--fixed-length", type=int, default=None,
                        help="per-document tokens of sweep (b) (default 1024)")
    parser.add_argument("--out", type=Path, default=Path("eval/runs"),
                        help="folder of scaling.jsonl (one record per measured shape: a rerun measures only the "
                             "missing ones), scaling_summary.json and scaling.png")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON here")
    parser.add_argument("--strict", action="store_true",
                        help="exit with status 1 unless every target is judged and passes (so always with --quick)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    return args


def build_shapes(args: argparse.Namespace) -> list[Shape]:
    """Sweep (a) then sweep (b); a shape in both sweeps (4 x 1k by default) is measured once."""
    scale = 4 if args.quick else 1
    lengths = args.doc_lengths or [n // scale for n in FULL_SWEEP["lengths"]]
    counts = args.doc_counts or list(FULL_SWEEP["counts"])
    fixed_count = args.fixed_count or FULL_SWEEP["fixed_count"]
    fixed_length = args.fixed_length or FULL_SWEEP["fixed_length"] // scale
    sweeps: dict[tuple[int, int], list[str]] = {}
    for length in lengths:
        sweeps.setdefault((fixed_count, length), []).append("a")
    for count in counts:
        sweeps.setdefault((count, fixed_length), []).append("b")
    return [Shape(n, size, tuple(names)) for (n, size), names in sweeps.items()]


def random_model_dir(args: argparse.Namespace, workdir: Path, max_tokens: int) -> Path:
    """Write the seeded random study model of ``--architecture`` (with --hidden-size/--layers) under ``workdir``."""
    model_type = ARCHITECTURES[args.architecture]
    study = architecture(model_type).study
    assert study is not None
    fields = dict(study(args.hidden_size, args.layers), max_position_embeddings=max(4096, max_tokens + 64))
    return write_random_checkpoint(workdir / "model", model_type, args.seed, **fields)


def make_document(tokenizer: TextTokenizer, n_tokens: int, rng: random.Random) -> str:
    """Random lowercase words of exactly ``n_tokens`` tokens with the byte-level tokenizer (close to it
    with another tokenizer: the text is cut at ``n_tokens`` ids and decoded)."""
    words: list[str] = []
    length = 0
    while length < n_tokens:
        word = "".join(rng.choice(WORD_CHARS) for _ in range(rng.randint(2, 9)))
        words.append(word)
        length += len(word) + 1
    text = " ".join(words)[:n_tokens]
    ids = tokenizer.encode(text)
    if len(ids) == n_tokens:
        return text
    while len(ids) < n_tokens:  # a tokenizer with multi-byte tokens: grow the text, then cut by ids
        text += " " + text
        ids = tokenizer.encode(text)
    return tokenizer.decode(ids[:n_tokens])


def documents_for(engine: Engine, shape: Shape, seed: int) -> list[str]:
    """The shape's documents; document i of a given length is the same in every shape (fewer to cache)."""
    return [make_document(engine.tokenizer, shape.doc_tokens, random.Random(f"{seed}-{shape.doc_tokens}-{i}"))
            for i in range(shape.num_docs)]


def build_prompt(documents: list[str], separator: str = DEFAULT_SEPARATOR) -> str:
    """``L SEP C1 SEP ... SEP Cn SEP Q``."""
    return separator.join([LEADING, *documents, QUESTION])


def check_all_hit(result: GenerationResult, num_docs: int) -> None:
    """Fail loudly unless a hypic request spliced every document from cache."""
    if result.segments_hit != num_docs or result.segments_missed != 0:
        raise AssertionError(f"hypic hit {result.segments_hit} of {num_docs} documents "
                             f"({result.segments_missed} missed): the warm-up did not cache them all")


def timed_runs(engine: Engine, prompt: str, mode: Mode, repeats: int) -> list[GenerationResult]:
    """One untimed warm-up request, then ``repeats`` timed ones (TTFT of one generated token)."""
    engine.generate(prompt, max_new_tokens=1, mode=mode)
    return [engine.generate(prompt, max_new_tokens=1, mode=mode) for _ in range(repeats)]


def measure_shape(engine: Engine, shape: Shape, repeats: int, seed: int) -> ShapeResult:
    """Cache the shape's documents, then the median TTFT of hypic and of full recompute."""
    documents = documents_for(engine, shape, seed)
    prompt = build_prompt(documents, engine.pic_separator)
    start = time.perf_counter()
    engine.warmup(documents)
    check_all_hit(engine.generate(prompt, max_new_tokens=1, mode="hypic"), shape.num_docs)
    warmup_s = time.perf_counter() - start
    hypic_runs = timed_runs(engine, prompt, Mode.HYPIC, repeats)
    for result in hypic_runs:
        check_all_hit(result, shape.num_docs)
    full_runs = timed_runs(engine, prompt, Mode.FULL, repeats)
    hypic_ms = [r.ttft_s * 1e3 for r in hypic_runs]
    full_ms = [r.ttft_s * 1e3 for r in full_runs]
    hypic_median, full_median = statistics.median(hypic_ms), statistics.median(full_ms)
    last = hypic_runs[-1]
    lo, hi = engine.seams.interior(shape.doc_tokens) or (0, 0)
    entry = next(e for e in engine.cache.held_documents(list(engine.cache.document_keys())) if e.length == hi - lo)
    return ShapeResult(
        label=shape.label, sweeps=list(shape.sweeps), num_docs=shape.num_docs, doc_tokens=shape.doc_tokens,
        prompt_tokens=last.prompt_tokens, full_ttft_ms=full_median, hypic_ttft_ms=hypic_median,
        speedup=full_median / hypic_median, segments_hit=last.segments_hit, hypic_cached_tokens=last.cached_tokens,
        hypic_recomputed_tokens=last.recomputed_tokens, hypic_combine_tokens=last.stats.combine_tokens,
        full_recomputed_tokens=full_runs[-1].recomputed_tokens, warmup_s=warmup_s,
        transition_bytes_per_doc=sum(layer.transition.nbytes for layer in entry.layers
                                     if isinstance(layer, LinearInterior) and layer.transition is not None),
        entry_bytes_per_doc=entry.nbytes,
        full_samples_ms=full_ms, hypic_samples_ms=hypic_ms,
    )


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Slope of the least-squares line through (xs, ys); None with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return None
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
    return covariance / sum((x - mean_x) ** 2 for x in xs)


def document_slopes(results: list[ShapeResult]) -> dict[str, float | None]:
    """Sweep (b): ms per extra document for each mode and the ratio full / hypic."""
    sweep = [r for r in results if "b" in r.sweeps]
    counts = [r.num_docs for r in sweep]
    full = least_squares_slope(counts, [r.full_ttft_ms for r in sweep])
    hypic_slope = least_squares_slope(counts, [r.hypic_ttft_ms for r in sweep])
    ratio = None
    if full is not None and hypic_slope is not None:
        ratio = full / hypic_slope if hypic_slope > 0 else float("inf")  # flat or noise-negative: no growth
    return {"full_ms_per_doc": full, "hypic_ms_per_doc": hypic_slope, "ratio": ratio}


def speedup_target(results: list[ShapeResult]) -> Target:
    """The worst speed-up at the prompts of ``TARGET_DOC_TOKENS`` document tokens against its bar; not
    judged (the longest prompts' speed-up shown) where no shape has that size."""
    defined = [r for r in results if r.num_docs * r.doc_tokens == TARGET_DOC_TOKENS]
    longest = max(r.num_docs * r.doc_tokens for r in results)
    shown = defined or [r for r in results if r.num_docs * r.doc_tokens == longest]
    worst = min(shown, key=lambda r: r.speedup)
    detail = ", ".join(f"{r.label} {r.speedup:.1f}x" for r in shown)
    if not defined:
        return Target(f"speedup at the longest prompts ({longest} document tokens)", worst.speedup, SPEEDUP_TARGET,
                      None, f"not judged: target defined for {TARGET_DOC_TOKENS}-token prompts (4x4k or 16x1k "
                            f"documents); {detail}")
    return Target(f"speedup at the {TARGET_DOC_TOKENS}-token prompts", worst.speedup, SPEEDUP_TARGET,
                  worst.speedup >= SPEEDUP_TARGET, detail)


def _shape_list(shapes: Sequence[tuple[int, int]]) -> str:
    """``4x1024 8x1024``: (documents, tokens each) pairs as text."""
    return " ".join(f"{n}x{t}" for n, t in shapes) or "none"


def slope_target(results: list[ShapeResult], slopes: dict[str, float | None]) -> Target:
    """The full / hypic per-document cost ratio against its bar; judged only where sweep (b) is
    ``SLOPE_TARGET_SHAPES`` (the slopes grow with the document length and count)."""
    ratio = slopes["ratio"]
    detail = ("sweep (b) needs two or more document counts" if ratio is None else
              f"full {slopes['full_ms_per_doc']:.1f} ms/doc vs hypic {slopes['hypic_ms_per_doc']:.2f} ms/doc")
    sweep = sorted((r.num_docs, r.doc_tokens) for r in results if "b" in r.sweeps)
    if sweep != sorted(SLOPE_TARGET_SHAPES):
        detail = (f"not judged: target defined for sweep (b) = {_shape_list(SLOPE_TARGET_SHAPES)} (up to "
                  f"{TARGET_DOC_TOKENS}-token prompts); here {_shape_list(sweep)}; {detail}")
        return Target("per-extra-document cost, full / hypic", ratio, SLOPE_RATIO_TARGET, None, detail)
    return Target("per-extra-document cost, full / hypic", ratio, SLOPE_RATIO_TARGET,
                  ratio is not None and ratio >= SLOPE_RATIO_TARGET, detail)


def evaluate_targets(results: list[ShapeResult], slopes: dict[str, float | None]) -> list[Target]:
    """The speed-up and per-document slope targets, each judged only at the sizes it is defined for."""
    return [speedup_target(results), slope_target(results, slopes)]


def judge(results: list[ShapeResult]) -> dict[str, Any]:
    """The slopes of sweep (b), the targets, and ``all_passed``: every target judged and passed."""
    slopes = document_slopes(results)
    targets = evaluate_targets(results, slopes)
    return {"slopes": slopes, "targets": [asdict(t) for t in targets],
            "all_passed": all(t.passed is True for t in targets)}


def format_table(results: list[ShapeResult]) -> str:
    """Per-sweep rows: shape, prompt tokens, full TTFT ms, hypic TTFT ms, speedup, T_C and entry bytes per document."""
    header = (f"{'sweep':<6}{'shape':<8}{'prompt tok':>11}{'hypic recomp':>13}{'full ms':>11}{'hypic ms':>10}"
              f"{'speedup':>9}{'T_C B/doc':>11}{'entry KiB/doc':>15}")
    lines = [header, "-" * len(header)]
    for sweep in ("a", "b"):
        for r in (r for r in results if sweep in r.sweeps):
            lines.append(f"({sweep})   {r.label:<8}{r.prompt_tokens:>11}{r.hypic_recomputed_tokens:>13}"
                         f"{r.full_ttft_ms:>11.1f}{r.hypic_ttft_ms:>10.1f}{r.speedup:>8.1f}x"
                         f"{r.transition_bytes_per_doc:>11}{r.entry_bytes_per_doc / 1024:>15.1f}")
    return "\n".join(lines)


def format_slopes(slopes: dict[str, float | None]) -> str:
    """The incremental per-document cost lines of sweep (b)."""
    if slopes["ratio"] is None:
        return "sweep (b): fewer than two document counts, no per-document slope"
    ratio = slopes["ratio"]
    ratio_text = "inf (hypic flat)" if ratio == float("inf") else f"{ratio:.1f}x"
    return (f"sweep (b) cost per extra document (least-squares slope): full {slopes['full_ms_per_doc']:.1f} ms/doc, "
            f"hypic {slopes['hypic_ms_per_doc']:.2f} ms/doc, ratio {ratio_text}")


def format_targets(targets: list[Target]) -> str:
    """One PASS / FAIL / NOT JUDGED line per target."""
    lines = []
    for t in targets:
        value = "n/a" if t.value is None else ("inf" if t.value == float("inf") else f"{t.value:.1f}x")
        verdict = "NOT JUDGED" if t.passed is None else "PASS" if t.passed else "FAIL"
        lines.append(f"{verdict}: {t.name} = {value} (target >= {t.threshold:.0f}x; {t.detail})")
    return "\n".join(lines)


def environment(args: argparse.Namespace, model: str, engine: Engine) -> dict[str, Any]:
    """What the numbers were measured on."""
    config = engine.model.config
    return {
        "model": model, "python": platform.python_version(), "torch": torch.__version__,
        "hypic": hypic.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "device": str(engine.model.device), "dtype": str(engine.model.dtype), "seam_width": engine.seam_width,
        "hidden_size": config.hidden_size, "layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types), "repeats": args.repeats, "seed": args.seed, "quick": args.quick,
    }


def _json_safe(value: Any) -> Any:
    """inf -> the string "inf" (JSON has no infinity)."""
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def run_key(args: argparse.Namespace, model_label: str) -> str:
    """What a recorded shape was measured with: only records of the same key are reused."""
    model = model_label if args.model is not None else f"{model_label} h{args.hidden_size} l{args.layers}"
    return f"{model} seed{args.seed} w{args.seam_width} t{args.threads} r{args.repeats}"


def measured_shapes(engine: Engine, shapes: list[Shape], args: argparse.Namespace, key: str) -> list[ShapeResult]:
    """Each shape's result: from ``OUT/scaling.jsonl`` where recorded under ``key``, else measured and appended."""
    log = ResultLog(args.out / "scaling.jsonl")
    results = []
    progress = tqdm(shapes, desc="shapes", unit="shape", disable=args.no_progress, file=sys.stderr)
    for shape in progress:
        progress.set_postfix_str(shape.label)
        record = log.get((key, shape.label, f"hypic:{args.seam_width}"))
        if record is None:
            record = {"dataset": key, "sample": shape.label, "method": f"hypic:{args.seam_width}",
                      "result": asdict(measure_shape(engine, shape, args.repeats, args.seed))}
            log.add(record)
        results.append(ShapeResult(**{**record["result"], "sweeps": list(shape.sweeps)}))
    return results


def run_benchmark(args: argparse.Namespace, model_dir: Path, model_label: str) -> dict[str, Any]:
    """Load the engine, measure every shape not yet recorded, and assemble the results."""
    engine = Engine.from_pretrained(model_dir, seam_width=args.seam_width, private_pool_bytes=0)
    shapes = build_shapes(args)
    seams = engine.seams
    if any(seams.interior(shape.doc_tokens) is None for shape in shapes):
        raise SystemExit(f"every document must be longer than its two seams ({seams.head} + {seams.tail} tokens)")
    results = measured_shapes(engine, shapes, args, run_key(args, model_label))
    return {"environment": environment(args, model_label, engine), "shapes": [asdict(r) for r in results],
            **judge(results), "strict": args.strict}


def scaling_figure(results: list[ShapeResult], path: Path) -> None:
    """TTFT of full recompute and hypic against document length (sweep a) and count (sweep b), each
    hypic point labelled with its speed-up."""
    from .studies import pyplot, save_figure
    plt = pyplot()
    figure, panels = plt.subplots(1, 2, figsize=(9.5, 3.8))
    for axes, sweep, x_of, xlabel in ((panels[0], "a", lambda r: r.doc_tokens, "tokens per document"),
                                      (panels[1], "b", lambda r: r.num_docs, "documents")):
        mine = sorted((r for r in results if sweep in r.sweeps), key=x_of)
        xs = [x_of(r) for r in mine]
        axes.plot(xs, [r.full_ttft_ms for r in mine], marker="o", label="full recompute")
        axes.plot(xs, [r.hypic_ttft_ms for r in mine], marker="o", label="hypic (documents cached)")
        for x, r in zip(xs, mine):
            axes.annotate(f"{r.speedup:.1f}x", (x, r.hypic_ttft_ms), textcoords="offset points", xytext=(0, 6),
                          ha="center", fontsize=8)
        fixed = f"{mine[0].num_docs} documents" if sweep == "a" and mine else (
            f"{mine[0].doc_tokens} tokens each" if mine else "")
        axes.set(xlabel=xlabel, ylabel="TTFT (ms)", title=f"({sweep}) {fixed}")
    panels[0].legend(fontsize=8)
    save_figure(figure, path)


def report(results: dict[str, Any]) -> str:
    """The printed summary: environment line, table, slopes and targets."""
    env = results["environment"]
    shapes = [ShapeResult(**r) for r in results["shapes"]]
    targets = [Target(**t) for t in results["targets"]]
    head = (f"HYPIC composition scaling (paper Fig. 12) - model {env['model']}, hidden {env['hidden_size']}, "
            f"{env['layers']} layers, {env['device']} {env['dtype'].removeprefix('torch.')}, "
            f"{env['threads']} thread(s), w={env['seam_width']}, median of {env['repeats']}, "
            f"wall {results['wall_s']:.0f} s")
    return "\n".join([head, "", format_table(shapes), "", format_slopes(results["slopes"]), "",
                      format_targets(targets)])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweeps, print the report, optionally write JSON; returns the results dict."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    if args.model is not None:
        results = run_benchmark(args, args.model, str(args.model))
    else:
        longest = max(s.num_docs * s.doc_tokens for s in build_shapes(args)) + 2 * len(QUESTION) + 2 * len(LEADING)
        with tempfile.TemporaryDirectory(prefix="hypic-bench-") as workdir:
            model_dir = random_model_dir(args, Path(workdir), longest)
            results = run_benchmark(args, model_dir, f"random {ARCHITECTURES[args.architecture]}")
    results["wall_s"] = time.perf_counter() - start
    print(report(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling_summary.json").write_text(json.dumps(_json_safe(results), indent=2) + "\n")
    scaling_figure([ShapeResult(**r) for r in results["shapes"]], args.out / "scaling.png")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_json_safe(results), indent=2) + "\n")
        print(f"results written to {args.json}")
    return results
