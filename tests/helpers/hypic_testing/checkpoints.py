"""Checkpoints rewritten for tests: ``make_long_memory`` turns a tiny random checkpoint into one whose
linear states carry a document far enough to change the logits."""
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hypic.models.arch import parse_config

LONG_MEMORY_DECAY = 0.01  # A of every linear head: state decays by about exp(-0.01 * softplus) per token
LONG_MEMORY_OUTPUT_GAIN = 5.0  # token mixers' output projections scaled so their output rules the residual


def make_long_memory(path: str | Path) -> Path:
    """Rewrite a checkpoint in place so that what one document leaves in the linear states shapes the
    logits: slow decay in every linear layer (A = 0.01) and token-mixer outputs that dominate the
    residual stream. On such a model HYPIC's approximation above layer 0 is O(1) (greedy outputs of
    HYPIC and full recompute differ), so a test can tell a right combine pass from full recompute."""
    weights = Path(path) / "model.safetensors"
    tensors, bound = load_file(str(weights)), _decay_bound(Path(path))
    for name, tensor in tensors.items():
        if name.endswith("A_log"):  # a bounded decay: rate 1, dt_bias below (see _decay_bound)
            tensors[name] = torch.full_like(tensor, math.log(LONG_MEMORY_DECAY) if bound is None else 0.0)
        elif name.endswith("dt_bias") and bound is not None:  # bound sigmoid(x) ~ bound e^x = -LONG_MEMORY_DECAY
            tensors[name] = torch.full_like(tensor, math.log(LONG_MEMORY_DECAY / -bound))
        elif name.endswith(("linear_attn.out_proj.weight", "self_attn.o_proj.weight", "self_attn.out_proj.weight",
                            "mamba.out_proj.weight", "mixer.out_proj.weight", "mixer.o_proj.weight",
                            "attention.dense.weight")):
            tensors[name] = tensor * LONG_MEMORY_OUTPUT_GAIN
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return Path(path)


def _decay_bound(path: Path) -> float | None:
    """The lower bound of a bounded KDA decay g = bound sigmoid(exp(A_log) (f + dt_bias)) (Bailing's), as
    the checkpoint's parsed config says; None: g = -exp(A_log) softplus(...), made slow by a small A alone."""
    return parse_config(json.loads((path / "config.json").read_text())).kda_gates.lower_bound


FAST_DECAY = 1.0  # A of a fast head: g ~ -softplus(1) ~ -1.3 a token: T_C underflows within ~100 tokens, a 3-token seam keeps ~2%


def make_fast_decay(path: str | Path, heads: slice = slice(None)) -> Path:
    """Rewrite a (long-memory) Gated DeltaNet or KDA checkpoint in place so that the linear heads
    ``heads`` forget fast: A = FAST_DECAY and, for KDA's per-channel gate, dt_bias = 1 on their
    channels. The other heads keep their gates."""
    weights = Path(path) / "model.safetensors"
    tensors = load_file(str(weights))
    for name, tensor in tensors.items():
        if name.endswith("A_log"):
            flat = tensor.reshape(-1).clone()  # [H] for Gated DeltaNet, [1, 1, H, 1] for KDA
            flat[heads] = math.log(FAST_DECAY)
            tensors[name] = flat.reshape(tensor.shape)
        elif name.endswith("dt_bias") and "self_attn" in name:  # KDA: one bias per head and channel
            rows = tensor.reshape(tensors[name.replace("dt_bias", "A_log")].numel(), -1).clone()
            rows[heads] = 1.0
            tensors[name] = rows.reshape(tensor.shape)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return Path(path)
