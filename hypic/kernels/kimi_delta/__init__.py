"""Kimi Delta Attention (the gated delta rule with a decay per key channel): its kernels
(``KERNELS``) and one interface, the fastest correct path for the device (``hypic.kernels.dispatch``).

Runs of at least ``SHORT_RUN`` tokens: FLA's ``chunk_kda`` on CUDA when installed, else the
PyTorch chunked form. Shorter runs (decode): the token loop on every device. A run's transition
is a dense K x K matrix per head: the final state of the same run from the identity under zero values.
"""
import torch

from ..dispatch import RecurrenceKernels, run_recurrence, run_with_transition
from .chunk import chunk_kimi_delta_rule, chunk_kimi_delta_rule_with_transition, kimi_delta_chunk_maps
from .naive import naive_kimi_delta_rule, naive_kimi_transition

SHORT_RUN = 4  # below this the token loop beats the chunk form on CPU
CPU_CHUNK = 8  # the CPU chunk size: measured fastest from 8 to 2048 tokens, K = 64 and 128


def chunk_size_for(steps: int, device: torch.device) -> int:
    return CPU_CHUNK


def _naive_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor) -> torch.Tensor:
    return naive_kimi_transition(k, g, beta)


KERNELS = RecurrenceKernels(
    naive=naive_kimi_delta_rule, chunked=chunk_kimi_delta_rule, chunk_size=chunk_size_for,
    fla=("kda", "chunk_kda"), short_run=SHORT_RUN,
    naive_transition=_naive_transition, chunked_with_transition=chunk_kimi_delta_rule_with_transition,
    chunk_maps=kimi_delta_chunk_maps,
)


def kimi_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor | None = None,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K] (l2-normalised); v [T, H, V]; g [T, H, K] (log decay per key channel);
    beta [T, H]; initial_state [H, K, V] (None: zeros). Returns o [T, H, V] fp32 and the final
    state [H, K, V] fp32."""
    return run_recurrence(KERNELS, (q, k, v, g, beta), initial_state, scale)


def kimi_delta_rule_with_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, initial_state: torch.Tensor,
                                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kimi_delta_rule`` from ``initial_state`` that also returns the run's transition
    T [H, K, K] (final state = T @ initial_state + the final state from zero)."""
    return run_with_transition(KERNELS, (q, k, v, g, beta), initial_state, scale)


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


__all__ = ["KERNELS", "kimi_delta_rule", "kimi_delta_rule_with_transition", "kimi_delta_step", "chunk_kimi_delta_rule",
           "chunk_kimi_delta_rule_with_transition", "naive_kimi_delta_rule", "naive_kimi_transition"]
