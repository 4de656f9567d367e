"""Linear attention with a scalar gate per head (S_t = exp(g_t) S_{t-1} + k_t v_t^T): its kernels
(``KERNELS``) and one interface, the fastest correct path for the device (``hypic.kernels.dispatch``).

FLA's ``chunk_simple_gla`` on CUDA when installed, else the PyTorch chunked form; runs shorter than
``SHORT_RUN`` tokens (decode) take the token loop. A run's transition is closed-form: the product
of its gates, exp(sum_t g_t) per head (``hypic.cache.composition.scalar_transition``).
"""
import torch

from ..dispatch import RecurrenceKernels, run_recurrence, unit_scale
from .chunk import chunk_scalar_gla, scalar_gla_chunk_maps
from .naive import naive_scalar_gla

SHORT_RUN = 4


def chunk_size_for(steps: int, device: torch.device) -> int:
    """64 on CUDA (without FLA), 32 on CPU."""
    return 64 if device.type == "cuda" else 32


KERNELS = RecurrenceKernels(
    naive=naive_scalar_gla, chunked=chunk_scalar_gla, chunk_size=chunk_size_for, scale=unit_scale, fla=("simple_gla", "chunk_simple_gla"), short_run=SHORT_RUN,
    chunk_maps=scalar_gla_chunk_maps,
)


def scalar_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               initial_state: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K]; v [T, H, V]; g [T, H] log decay; initial_state [H, K, V].
    Returns o [T, H, V] fp32 and the final state [H, K, V] fp32."""
    return run_recurrence(KERNELS, (q, k, v, g), initial_state, scale)


def scalar_gla_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B requests: state [B, H, K, V]; q, k [B, H, K]; v [B, H, V]; g [B, H].
    Returns o [B, H, V] fp32 and the new state (the token loop's formula, batched)."""
    state = state * g.float().exp()[..., None, None] + k.float()[..., :, None] * v.float()[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q.float() * scale, state), state


__all__ = ["KERNELS", "scalar_gla", "scalar_gla_step", "chunk_scalar_gla", "naive_scalar_gla"]
