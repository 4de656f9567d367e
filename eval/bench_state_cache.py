"""Public-pool entry size per document and layer-0 error, per storage precision of T_C and S_C|0.

For each ``--state-cache-dtypes`` entry: a document of ``--doc-tokens`` tokens is cached and its
entry's bytes are split into T_C, S_C|0, conv tails and interior KV, next to the closed form
(paper Table 3: per head and layer T_C is d_k x d_k and S_C|0 d_k x d_v values of the storage
dtype); then four such documents are spliced behind a leading part and the composed layer-0
state is compared with full recompute (relative L2). Composition computes in float32 whatever
the storage precision, so the error is the storage rounding alone.

    python eval/bench_state_cache.py                      # the default model
    python eval/bench_state_cache.py --model PATH --doc-tokens 1024
"""
import argparse
import random
import sys
from typing import Any

import torch

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.cache.store import AttentionInterior, LinearInterior

WORDS = "river city company founder year product capital language mayor population museum bridge".split()


def _document(engine: Engine, tokens: int, seed: int) -> str:
    rng, text = random.Random(seed), ""
    while len(engine.tokenizer.encode(text)) < tokens:
        text += " " + rng.choice(WORDS)
    return text


def entry_breakdown(engine: Engine, document: str) -> dict[str, int]:
    """Bytes of one cached document, by part."""
    engine.warmup([document])
    entry = next(iter(engine.cache.public.entries.values()))
    parts = dict.fromkeys(("transition", "zero_start_state", "conv_tail", "kv"), 0)
    for layer in entry.layers:
        if isinstance(layer, LinearInterior):
            parts["transition"] += layer.transition.nbytes if layer.transition is not None else 0
            parts["zero_start_state"] += layer.zero_start_state.numel() * layer.zero_start_state.element_size()
            parts["conv_tail"] += layer.conv_tail.numel() * layer.conv_tail.element_size()
        elif isinstance(layer, AttentionInterior):
            parts["kv"] += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return {**parts, "total": entry.nbytes}


def closed_form(engine: Engine, dtype: torch.dtype) -> dict[str, int]:
    config, size = engine.model.config, torch.empty(0, dtype=dtype).element_size()
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    layers = len(config.linear_layers())
    return {"transition": layers * hv * dk * dk * size, "zero_start_state": layers * hv * dk * dv * size}


def layer0_error(engine: Engine, documents: list[str]) -> float:
    prompt = DEFAULT_SEPARATOR.join(["Answer from the documents.", *documents, "Question?"])
    engine.warmup(documents)
    first = engine.model.config.linear_layers()[0]
    hypic = engine.prefill(engine.parse(prompt), "hypic").state.layers[first].recurrent
    full = engine.prefill(engine.parse(prompt), "full").state.layers[first].recurrent
    return ((hypic - full).norm() / full.norm()).item()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="checkpoint directory (default: the shipped model)")
    parser.add_argument("--doc-tokens", type=int, default=280, help="tokens per document (default: 280)")
    parser.add_argument("--state-cache-dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    rows = []
    for name in args.state_cache_dtypes:
        engine = Engine.from_pretrained(args.model, dtype="float32", state_cache_dtype=name, private_pool_bytes=0)
        documents = [_document(engine, args.doc_tokens, seed) for seed in range(4)]
        parts = entry_breakdown(engine, documents[0])
        expected = closed_form(engine, engine.state_cache_dtype)
        assert parts["transition"] == expected["transition"] and parts["zero_start_state"] == expected["zero_start_state"]
        rows.append({"dtype": name, **parts, "layer0_rel_l2": layer0_error(engine, documents)})
    print(f"{'dtype':<10}{'T_C B':>10}{'S_C|0 B':>10}{'conv B':>9}{'KV B':>10}{'total B':>10}{'vs fp32':>9}{'layer-0 err':>13}")
    for row in rows:
        print(f"{row['dtype']:<10}{row['transition']:>10}{row['zero_start_state']:>10}{row['conv_tail']:>9}{row['kv']:>10}"
              f"{row['total']:>10}{row['total'] / rows[0]['total']:>9.2f}{row['layer0_rel_l2']:>13.2e}")
    print("T_C and S_C|0 match the closed form (layers x heads x d_k x d_k / d_v x bytes) for every dtype.")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
