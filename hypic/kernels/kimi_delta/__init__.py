"""Kimi Delta Attention (the gated delta rule with a decay per key channel):
one interface, the fastest correct path for the device.

Runs of at least ``SHORT_RUN`` tokens: FLA's ``chunk_kda`` on CUDA when installed, else the
PyTorch chunked form. Shorter runs (decode): the token loop on every device. A run's transition
is a dense K x K matrix per head: the final state of the same run from the identity under zero values.
"""
import torch

from ..fla_calls import fla_kernel, fla_run, fla_transition
from .chunk import chunk_kimi_delta_rule, chunk_kimi_delta_rule_with_transition
from .naive import naive_kimi_delta_rule, naive_kimi_transition

FLA_KERNEL = ("kda", "chunk_kda")  # fla.ops.<module>.<name>, on CUDA
SHORT_RUN = 4  # below this the token loop beats the chunk form on CPU
CPU_CHUNK = 8  # the CPU chunk size: measured fastest from 8 to 2048 tokens, K = 64 and 128


def kimi_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K] (l2-normalised); v [T, H, V]; g [T, H, K] (log decay per key channel);
    beta [T, H]; initial_state [H, K, V] (None: zeros). Returns o [T, H, V] fp32 and the final
    state [H, K, V] fp32."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[0] < SHORT_RUN:
        return naive_kimi_delta_rule(q, k, v, g, beta, initial_state, scale)
    chunk = fla_kernel(*FLA_KERNEL) if q.is_cuda else None
    if chunk is not None:
        return fla_run(chunk, q, k, v, g, beta, initial_state, scale)
    return chunk_kimi_delta_rule(q, k, v, g, beta, initial_state, scale, CPU_CHUNK)


def kimi_delta_rule_with_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, initial_state: torch.Tensor,
                                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kimi_delta_rule`` from ``initial_state`` that also returns the run's transition
    T [H, K, K] (final state = T @ initial_state + the final state from zero)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[0] < SHORT_RUN:
        return (*naive_kimi_delta_rule(q, k, v, g, beta, initial_state, scale), naive_kimi_transition(k, g, beta))
    chunk = fla_kernel(*FLA_KERNEL) if q.is_cuda else None
    if chunk is not None:
        return (*fla_run(chunk, q, k, v, g, beta, initial_state, scale), fla_transition(chunk, q, k, g, beta, scale))
    return chunk_kimi_delta_rule_with_transition(q, k, v, g, beta, initial_state, scale, CPU_CHUNK)


def kimi_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Kimi delta step for B requests: state [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V];
    beta [B, H]. Returns o [B, H, V] fp32 and the new state fp32 (the naive kernel's formula, batched)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = state.float() * g.exp()[..., None]  # decay each key channel before the recall
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * k.shape[-1] ** -0.5, state), state


__all__ = ["kimi_delta_rule", "kimi_delta_rule_with_transition", "kimi_delta_step", "chunk_kimi_delta_rule",
           "chunk_kimi_delta_rule_with_transition", "naive_kimi_delta_rule", "naive_kimi_transition"]
