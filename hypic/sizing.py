"""What a model's caches and work cost, from its config alone: bytes of a public-pool entry and of a
request's state, FLOPs of rebuilding a document, the private pool's snapshot spacing."""
import math

import torch

from .config import ModelConfig
from .cache.modes import ModePolicy
from .models.families import family_of

DEFAULT_SNAPSHOT_INTERVAL = 256


def default_snapshot_interval(config: ModelConfig) -> int:
    """Tokens between private-pool resume points: 256, or, for a sliding-window model, as many tokens
    as it takes their full-attention KV to cost what a resume point's window tails cost (rounded up
    to 256; MiMo-V2-Flash: 1280), so the tails never dominate the pool."""
    windows = config.window_layers()
    full = [i for i in config.attention_layers() if i not in windows]
    if not windows or not full:
        return DEFAULT_SNAPSHOT_INTERVAL
    tails = sum((config.window(i) or 0) * config.kv_elements(i) for i in windows)
    even = -(-tails // sum(config.kv_elements(i) for i in full))
    return max(DEFAULT_SNAPSHOT_INTERVAL, -(-even // DEFAULT_SNAPSHOT_INTERVAL) * DEFAULT_SNAPSHOT_INTERVAL)


def entry_bytes(config: ModelConfig, policy: ModePolicy, tokens: int, model_dtype: torch.dtype,
                state_dtype: torch.dtype) -> int:
    """Bytes of the public-pool entry of a ``tokens``-token document under ``policy`` (0: it has no
    interior): each attention layer's interior K and V (a window's worth at most), each linear
    layer's T_C, S_C|0 and conv tail."""
    interior = policy.seams.interior(tokens) if policy.seams is not None else None
    if interior is None:
        return 0
    length = interior[1] - interior[0]
    model_size, state_size = model_dtype.itemsize, state_dtype.itemsize
    attention = sum(min(length, config.window(i) or length) * config.kv_elements(i) for i in config.attention_layers())
    family = family_of(config)
    state = family.state_elements(config)
    transition = math.prod(family.transition_shape(config)) if policy.transitions else 0
    conv = (config.linear_conv_kernel_dim - 1) * config.linear_conv_channels
    return attention * model_size + len(config.linear_layers()) * ((state + transition) * state_size + conv * model_size)


def state_bytes(config: ModelConfig, dtype: torch.dtype, tokens: int, samples: int = 1,
                shared_tokens: int = 0) -> int:
    """Memory a request's state takes: KV of ``tokens`` tokens per sample in every full-attention
    layer (the first ``shared_tokens`` of them held once for all samples, which fork from the
    prompt without copying it), a window's ring in every sliding-window layer, plus each sample's
    linear-layer states (the server's admission budget)."""
    size = torch.empty(0, dtype=dtype).element_size()
    kv = rings = 0
    for index in config.attention_layers():  # per token held: a ring holds ``window`` tokens at any length
        window = config.window(index)
        if window is None:
            kv += (samples * (tokens - shared_tokens) + shared_tokens) * config.kv_elements(index) * size
        else:
            rings += window * config.kv_elements(index) * size
    recurrent = family_of(config).state_nbytes(config)
    conv = (config.linear_conv_kernel_dim - 1) * config.linear_conv_channels * size
    linear = (recurrent + conv) * len(config.linear_layers())
    return kv + samples * (rings + linear)


def parameter_count(model: torch.nn.Module) -> int:
    """Every parameter of ``model`` (every expert of an MoE)."""
    return sum(p.numel() for p in model.parameters())


def rebuild_flops(config: ModelConfig, parameters: int, tokens: int) -> float:
    """About the FLOPs of prefilling a ``tokens``-token document alone: 2 per parameter per token
    (every expert counted: an upper bound for MoE) and the attention layers' QK^T and AV over the
    causal triangle (a window's worth at most)."""
    attention = 0.0
    for index in config.attention_layers():
        window = config.window(index) or tokens
        attention += 4.0 * tokens * min(tokens, window) * config.num_attention_heads * config.head_dim / 2
    return 2.0 * parameters * tokens + attention
