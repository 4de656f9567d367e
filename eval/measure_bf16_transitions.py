"""What storing T_C in bfloat16 (a lossy option, not a default) costs in accuracy.

Each case is prefilled twice with every document warmed first: by an engine whose public pool
keeps T_C and S_C|0 in fp32 (exact: the fidelity tests hold it to the reference) and by one that
keeps T_C in bfloat16 (S_C|0 fp32; ``--both`` also measures the existing ``--state-cache-dtype
bfloat16``, which narrows both). Reported per case: the largest difference of any linear layer's
state after the prefill (absolute, and relative to that layer's largest |state| entry), the
largest difference of the first token's logits and of any of 16 greedy steps' logits (each side
decoding its own tokens), and whether the greedy tokens agree.

Cases: the fidelity tests' layouts (random text, byte-level tokenizer) on the long-memory copies
of tiny random checkpoints of the dense-T families (where a state error reaches the logits), and
the shipped default model on three 1k-token windows of docs/ prose behind a question.

    PYTHONPATH=.:tests/helpers python eval/measure_bf16_transitions.py --out eval/results/decayed_heads/bf16_transitions.jsonl
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.cache.store import LinearInterior
from hypic.loading.checkpoints import write_random_checkpoint
from hypic_testing.tiny_models import TINY_VARIANTS
from hypic.loading.default_model import DEFAULT_MODEL_DIR
from hypic.state import LinearLayerState

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["qwen3_5_text-ratio2", "qwen3_next-moe", "kimi_linear"]
ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.;:!?0123456789"
LAYOUTS = [(1, [70, 260, 41]), (21, [90, 170, 45]), (5, [20, 400, 120, 300, 60, 200])]  # (seed, document lengths)
STEPS = 16


def layout_text(seed: int, lengths: list[int], leading: int = 20, query: int = 15) -> tuple[list[str], str]:
    """The fidelity tests' layout: random text for the leading part, each document and the query."""
    rng = random.Random(seed)
    text = lambda n: "".join(rng.choice(ALPHABET) for _ in range(n))  # noqa: E731
    lead, documents, question = text(leading), [text(n) for n in lengths], text(query)
    return documents, SEP.join([lead, *documents, question])


def docs_case(engine: Engine) -> tuple[list[str], str]:
    documents = []
    for name in ("architecture.md", "operations.md", "families.md"):
        ids = engine.tokenizer.encode((ROOT / "docs" / name).read_text().replace(SEP, ""))[:1024]
        documents.append(engine.tokenizer.decode(ids))
    return documents, SEP.join(["Answer from the documents.", *documents, "What does a public-pool entry hold?"])


@contextlib.contextmanager
def transitions_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Entries built inside keep T_C in ``dtype`` (None: as the engine's state cache dtype says)."""
    original = LinearInterior.stored_as

    def narrowed(self: LinearInterior, stored: torch.dtype) -> LinearInterior:
        entry = original(self, stored)
        if entry.transition is None:
            return entry
        transition = entry.transition.with_value(entry.transition.value.to(dtype)).without_decayed()
        return LinearInterior(transition, entry.zero_start_state, entry.conv_tail, entry.owner)

    if dtype is not None:
        LinearInterior.stored_as = narrowed  # type: ignore[method-assign]
    try:
        yield
    finally:
        LinearInterior.stored_as = original  # type: ignore[method-assign]


def run(path: Path, documents: list[str], text: str, transition_dtype: torch.dtype | None,
        state_cache_dtype: str = "float32") -> dict[str, Any]:
    with transitions_in(transition_dtype):
        engine = Engine.from_pretrained(path, state_cache_dtype=state_cache_dtype)
        engine.warmup(documents)
    prefill = engine.prefill(engine.parse(text))
    states = [layer.recurrent.clone() for layer in prefill.state.layers if isinstance(layer, LinearLayerState)]
    logits, state, tokens, seen = prefill.logits, prefill.state, [], []
    for _ in range(STEPS):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits, state = engine.decode_step(state, tokens[-1])
    engine.close()
    return {"states": states, "logits": seen, "tokens": tokens, "hits": prefill.stats.segments_hit}


def compare(exact: dict[str, Any], lossy: dict[str, Any]) -> dict[str, Any]:
    state_abs = max(float((a - b).abs().max()) for a, b in zip(exact["states"], lossy["states"]))
    state_rel = max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
                    for a, b in zip(exact["states"], lossy["states"]))
    steps = [float((a - b).abs().max()) for a, b in zip(exact["logits"], lossy["logits"])]
    agree = next((i for i, (a, b) in enumerate(zip(exact["tokens"], lossy["tokens"])) if a != b), len(exact["tokens"]))
    return {"state_max_abs": state_abs, "state_max_rel": state_rel, "first_logits_max_abs": steps[0],
            "any_step_logits_max_abs": max(steps[:agree]) if agree else steps[0], "tokens_agree_for": agree,
            "hits": lossy["hits"]}


def cases(models: list[str]) -> Iterator[tuple[str, Path, list[str], str]]:
    for name in models:
        from hypic_testing.checkpoints import make_long_memory

        path = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        model_type, overrides = TINY_VARIANTS[name]
        write_random_checkpoint(path, model_type, 0, **overrides)
        make_long_memory(path)
        for seed, lengths in LAYOUTS:
            documents, text = layout_text(seed, lengths)
            yield f"{name} (long memory) layout {seed}", path, documents, text
    engine = Engine.from_pretrained(DEFAULT_MODEL_DIR)
    documents, text = docs_case(engine)
    engine.close()
    yield "default model, 3 x 1k tokens of docs/", DEFAULT_MODEL_DIR, documents, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--both", action="store_true", help="also --state-cache-dtype bfloat16 (T_C and S_C|0)")
    parser.add_argument("--out", type=Path, default=None, help="write one JSON record per case and option")
    args = parser.parse_args()
    records = []
    for label, path, documents, text in cases(args.models):
        exact = run(path, documents, text, None)
        options = [("T_C bf16", torch.bfloat16, "float32")] + ([("T_C and S_C|0 bf16", None, "bfloat16")] if args.both else [])
        for option, transition_dtype, cache_dtype in options:
            record = {"case": label, "option": option, **compare(exact, run(path, documents, text, transition_dtype,
                                                                              cache_dtype))}
            records.append(record)
            print(json.dumps(record), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in records))


if __name__ == "__main__":
    main()
