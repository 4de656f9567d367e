"""Gated linear attention with a gate per key channel (S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T):
its kernels (``KERNELS``) and one interface, the fastest correct path for the device
(``hypic.kernels.dispatch``).

FLA's ``chunk_gla`` on CUDA when installed, else the PyTorch chunked form; runs shorter than
``SHORT_RUN`` tokens (decode) take the token loop. A run's transition is closed-form: a vector per
head, exp(sum_t g_t) (``hypic.cache.composition.diagonal_transition``).
"""
import torch

from ..dispatch import RecurrenceKernels, run_recurrence, unit_scale
from .chunk import chunk_diagonal_gla, diagonal_gla_chunk_maps
from .naive import naive_diagonal_gla

SHORT_RUN = 4
CHUNK = 16  # the c x c x K decay factors grow with c


def chunk_size_for(steps: int, device: torch.device) -> int:
    return CHUNK


KERNELS = RecurrenceKernels(
    naive=naive_diagonal_gla, chunked=chunk_diagonal_gla, chunk_size=chunk_size_for,
    scale=unit_scale, fla=("gla", "chunk_gla"), short_run=SHORT_RUN, chunk_maps=diagonal_gla_chunk_maps,
)


def diagonal_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 initial_state: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g [T, H, K]; v [T, H, V]; initial_state [H, K, V] -> o [T, H, V] fp32, final state fp32."""
    return run_recurrence(KERNELS, (q, k, v, g), initial_state, scale)


def diagonal_gla_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B requests: state [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V]."""
    state = state * g.float().exp()[..., None] + k.float()[..., :, None] * v.float()[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q.float() * scale, state), state


__all__ = ["KERNELS", "diagonal_gla", "diagonal_gla_step", "chunk_diagonal_gla", "naive_diagonal_gla"]
