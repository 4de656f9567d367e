"""Decode speed against context length: tokens/s of one request and of B concurrent ones.

For each ``--contexts`` length a prompt of that many random tokens is prefilled once; the state is
copied to ``--batches`` requests, which then decode ``--steps`` tokens together (``decode_batch``),
timed after one untimed step. With KV that grows in place a step costs attention reads of the
context but no copy of it, so tokens/s should fall far less than the context grows.

    python eval/bench_decode.py                        # default-model shapes, random weights
    python eval/bench_decode.py --model PATH --contexts 1024 8192
"""
import argparse
import copy
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hypic import Engine, default_model_path
from hypic.loading.checkpoints import write_random_checkpoint
from hypic.decode import decode_batch


def random_model(workdir: Path, positions: int) -> Path:
    """A random model with the shipped default model's shapes and room for ``positions`` tokens."""
    import json

    config = json.loads((default_model_path() / "config.json").read_text())
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "layer_types")
    return write_random_checkpoint(workdir / "model", "qwen3_5_text", 0, max_position_embeddings=positions,
                                   **{k: config[k] for k in keys if k in config})


def _copies(state: Any, count: int) -> list[Any]:
    """``count`` independent states (decode may grow a state in place)."""
    if hasattr(state, "fork"):
        return [state] + [state.fork() for _ in range(count - 1)]
    return [copy.copy(state) for _ in range(count)]


def decode_rate(engine: Engine, context: int, batch: int, steps: int) -> float:
    """Tokens per second of ``batch`` requests decoding together after ``context`` tokens."""
    ids = [random.Random(context).randrange(engine.model.config.vocab_size - 1) for _ in range(context)]
    prefill = engine.prefill(engine.parse(ids), "full")
    states = _copies(prefill.state, batch)
    for state in states:
        if hasattr(state, "reserve"):
            state.reserve(context + steps + 1)
    tokens = [int(prefill.logits.argmax())] * batch
    _, states = decode_batch(engine.model, states, tokens)  # untimed: first-step costs
    start = time.perf_counter()
    for _ in range(steps):
        logits, states = decode_batch(engine.model, states, tokens)
        tokens = logits.argmax(-1).tolist()
    return batch * steps / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: random weights in the default model's shapes)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        path = Path(args.model) if args.model else random_model(Path(workdir), max(args.contexts) + args.steps + 8)
        engine = Engine.from_pretrained(path, dtype="float32", private_pool_bytes=0)
        for context in args.contexts:
            for batch in args.batches:
                rows.append({"context": context, "batch": batch, "tokens_per_s": decode_rate(engine, context, batch,
                                                                                             args.steps)})
                print(f"context {context:>6}  batch {batch:>3}  {rows[-1]['tokens_per_s']:8.1f} tokens/s", flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
