"""Linear attention with a scalar gate per head (S_t = exp(g_t) S_{t-1} + k_t v_t^T): one
interface, the fastest correct path for the device.

FLA's ``chunk_simple_gla`` on CUDA when installed, else the PyTorch chunked form; runs shorter than
``SHORT_RUN`` tokens (decode) take the token loop. A run's transition is closed-form: the product
of its gates, exp(sum_t g_t) per head (``hypic.cache.composition.scalar_transition``).
"""
import torch

from ..fla_calls import fla_kernel
from .chunk import chunk_scalar_gla
from .naive import naive_scalar_gla

SHORT_RUN = 4


def scalar_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               initial_state: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K]; v [T, H, V]; g [T, H] log decay; initial_state [H, K, V].
    Returns o [T, H, V] fp32 and the final state [H, K, V] fp32."""
    if q.shape[0] < SHORT_RUN:
        return naive_scalar_gla(q, k, v, g, initial_state, scale)
    chunk = fla_kernel("simple_gla", "chunk_simple_gla") if q.is_cuda else None
    if chunk is not None:
        out, state = chunk(q[None], k[None], v[None], g[None].float(), scale=scale, output_final_state=True,
                           initial_state=None if initial_state is None else initial_state[None].float())
        return out[0].float(), state[0].float()
    return chunk_scalar_gla(q, k, v, g, initial_state, scale, 64 if q.is_cuda else 32)




def scalar_gla_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for B requests: state [B, H, K, V]; q, k [B, H, K]; v [B, H, V]; g [B, H].
    Returns o [B, H, V] fp32 and the new state (the token loop's formula, batched)."""
    state = state * g.float().exp()[..., None, None] + k.float()[..., :, None] * v.float()[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q.float() * scale, state), state


__all__ = ["scalar_gla", "scalar_gla_step", "chunk_scalar_gla", "naive_scalar_gla"]
