"""Gated linear attention with a gate per key channel (S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T):
one interface, the fastest correct path for the device.

FLA's ``chunk_gla`` on CUDA when installed, else the PyTorch chunked form; runs shorter than
``SHORT_RUN`` tokens (decode) take the token loop. A run's transition is closed-form: a vector per
head, exp(sum_t g_t) (``hypic.cache.composition.diagonal_transition``).
"""
import torch

from ..fla_calls import fla_kernel
from .chunk import chunk_diagonal_gla
from .naive import naive_diagonal_gla

SHORT_RUN = 4


def diagonal_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 initial_state: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g [T, H, K]; v [T, H, V]; initial_state [H, K, V] -> o [T, H, V] fp32, final state fp32."""
    if q.shape[0] < SHORT_RUN:
        return naive_diagonal_gla(q, k, v, g, initial_state, scale)
    chunk = fla_kernel("gla", "chunk_gla") if q.is_cuda else None
    if chunk is not None:
        out, state = chunk(q[None], k[None], v[None], g[None].float(), scale=scale, output_final_state=True,
                           initial_state=None if initial_state is None else initial_state[None].float())
        return out[0].float(), state[0].float()
    return chunk_diagonal_gla(q, k, v, g, initial_state, scale)


def diagonal_gla_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B requests: state [B, H, K, V]; q, k, g [B, H, K]; v [B, H, V]."""
    state = state * g.float().exp()[..., None] + k.float()[..., :, None] * v.float()[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q.float() * scale, state), state


__all__ = ["diagonal_gla", "diagonal_gla_step", "chunk_diagonal_gla", "naive_diagonal_gla"]
