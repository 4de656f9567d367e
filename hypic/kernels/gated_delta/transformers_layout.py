"""Gated delta rules behind transformers' ``torch_chunk_gated_delta_rule`` signature.

Training runs transformers' own Qwen3.5 model. Its PyTorch fallback slices one chunk at a
time out of full-size tensors, so its backward pass fills and copies a full-size gradient
per chunk (a third of a CPU training step); on CUDA, which of FLA's kernels it binds
depends on the transformers version. ``training_gated_delta_rule`` picks the rule a
training run swaps in: FLA's Triton kernel on CUDA when installed, else our chunked form.
"""
import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .chunk import chunk_gated_delta_rule_heads_first

TransformersRule = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def _prepare_qk(query: torch.Tensor, key: torch.Tensor, heads: int,
                l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Key heads repeated to the value heads (Qwen3.5 GQA), optionally l2-normalised."""
    if key.shape[-2] != heads:
        query = query.repeat_interleave(heads // key.shape[-2], dim=2)
        key = key.repeat_interleave(heads // key.shape[-2], dim=2)
    if l2norm:
        query, key = (F.normalize(x.float(), dim=-1, eps=1e-6) for x in (query, key))
    return query, key


def transformers_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """query, key [B, T, Hk, K]; value [B, T, Hv, V]; g, beta [B, T, Hv]; state [B, Hv, K, V].

    Returns o [B, T, Hv, V] in the query's dtype and the final state (or None), exactly as
    transformers' fallback does (key heads repeated to the value heads, q scaled by K^-0.5).
    """
    dtype = query.dtype
    query, key = _prepare_qk(query, key, value.shape[-2], use_qk_l2norm_in_kernel)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, state = chunk_gated_delta_rule_heads_first(q, k, v, g.transpose(1, 2), beta.transpose(1, 2),
                                                    initial_state, chunk_size=chunk_size)
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def fla_transformers_chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same contract through FLA's chunked Triton kernel (CUDA only)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    query, key = _prepare_qk(query, key, value.shape[-2], use_qk_l2norm_in_kernel)
    query, key = query.to(value.dtype), key.to(value.dtype)  # the kernel wants one dtype
    return chunk_gated_delta_rule(query, key, value, g=g.float(), beta=beta.to(value.dtype),
                                  initial_state=initial_state,
                                  output_final_state=output_final_state)


@functools.cache
def fla_trains_here() -> bool:
    """Whether FLA's kernel imports and runs a backward pass on this GPU.

    FLA refuses its backward on Hopper with Triton 3.4-3.7.0 (wrong results there), which is
    what the H100 device image once had; a tiny forward + backward finds out once.
    """
    try:
        shape = dict(device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, 64, 1, 64, requires_grad=True, **shape)
        out, _ = fla_transformers_chunk_gated_delta_rule(
            q, q, torch.randn(1, 64, 1, 64, **shape), -torch.rand(1, 64, 1, device="cuda"),
            torch.rand(1, 64, 1, **shape), use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()
    except (ImportError, RuntimeError) as error:
        warnings.warn(f"FLA's gated delta rule cannot train here, using the PyTorch form: {error}")
        return False
    return True


def training_gated_delta_rule(device: torch.device, use_fla: bool = True) -> TransformersRule:
    """FLA's kernel on CUDA when it trains there (and ``use_fla``); else our chunked PyTorch form."""
    if device.type == "cuda" and use_fla and fla_trains_here():
        return fla_transformers_chunk_gated_delta_rule
    return transformers_chunk_gated_delta_rule
