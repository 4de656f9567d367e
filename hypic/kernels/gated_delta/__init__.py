"""Gated delta rule: its kernels (``KERNELS``) and one interface, the fastest correct path for the
device as ``hypic.kernels.dispatch`` picks it.

Runs of at least ``SHORT_RUN`` tokens: FLA's chunked Triton kernel on CUDA when installed,
else the PyTorch chunked form (on CPU with chunks of at most 32 tokens, fitted to short runs:
measured faster than 64 at every length). Shorter runs (decode): the token loop on every device.
FLA's fused-recurrent kernel is not used: on an H100 with FLA 0.6 / Triton 3.6 it returned
states off by 300x from a carried initial state.
"""
import torch

from ..dispatch import RecurrenceKernels, run_recurrence, run_varlen, run_with_transition
from .chunk import (chunk_gated_delta_rule, chunk_gated_delta_rule_heads_first, chunk_gated_delta_rule_with_transition,
                    gated_delta_chunk_maps)
from .naive import naive_gated_delta_rule, naive_transition

SHORT_RUN = 4  # below this the token loop beats the chunk form on CPU
CPU_CHUNK = 32  # the CPU chunk size for long runs; 64 on CUDA (FLA's)


def chunk_size_for(steps: int, device: torch.device) -> int:
    """The chunk size of a run: 64 on CUDA; on CPU the power of two covering the run, at most 32."""
    if device.type == "cuda":
        return 64
    return min(CPU_CHUNK, 1 << max(steps - 1, 1).bit_length())


def _naive_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor) -> torch.Tensor:
    return naive_transition(k, g, beta)


KERNELS = RecurrenceKernels(
    naive=naive_gated_delta_rule, chunked=chunk_gated_delta_rule, chunk_size=chunk_size_for,
    fla=("gated_delta_rule", "chunk_gated_delta_rule"), varlen=True, short_run=SHORT_RUN,
    naive_transition=_naive_transition, chunked_with_transition=chunk_gated_delta_rule_with_transition,
    chunk_maps=gated_delta_chunk_maps,
)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None = None,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K] (l2-normalised, expanded to value heads); v [T, H, V]; g, beta [T, H];
    initial_state [H, K, V]. Returns o [T, H, V] fp32 and final state [H, K, V] fp32."""
    return run_recurrence(KERNELS, (q, k, v, g, beta), initial_state, scale)


def gated_delta_rule_with_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor,
                                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` from ``initial_state`` that also returns the run's transition
    T [H, K, K] (final state = T @ initial_state + the final state from zero)."""
    return run_with_transition(KERNELS, (q, k, v, g, beta), initial_state, scale)


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            lengths: list[int], initial_states: torch.Tensor,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent runs laid end to end (``lengths``, summing to T), run r from ``initial_states[r]``
    [R, H, K, V]: o [T, H, V] fp32 and final states [R, H, K, V] fp32 (one FLA call on CUDA)."""
    return run_varlen(KERNELS, (q, k, v, g, beta), lengths, initial_states, scale)


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta rule step for B requests: state [B, H, K, V]; q, k [B, H, K]; v [B, H, V];
    g, beta [B, H]. Returns o [B, H, V] and the new state (the naive kernel's formula, batched)."""
    state = state * g.exp()[..., None, None]
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * k.shape[-1] ** -0.5, state), state


__all__ = ["KERNELS", "gated_delta_step", "gated_delta_rule", "gated_delta_rule_varlen", "gated_delta_rule_with_transition",
           "chunk_gated_delta_rule",
           "chunk_gated_delta_rule_heads_first", "chunk_gated_delta_rule_with_transition",
           "naive_gated_delta_rule", "naive_transition", "chunk_size_for"]
