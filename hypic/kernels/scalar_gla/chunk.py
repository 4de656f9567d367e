"""Chunked form of scalar-gated linear attention in PyTorch (the CPU path, and CUDA without FLA).

Within a chunk of c tokens with cumulative log decay b_i = g_1 + ... + g_i:
  o_i = scale * q_i^T (exp(b_i) S_0 + sum_{j <= i} exp(b_i - b_j) k_j v_j^T)
  S_c = exp(b_c) S_0 + sum_j exp(b_c - b_j) k_j v_j^T
so each chunk is two matmuls against the entering state and one masked c x c attention.
"""
import torch

from ..affine_chain import AffineMaps
from ..dispatch import ChunkMaps, prefix_decays


def chunk_scalar_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     initial_state: torch.Tensor | None = None, scale: float = 1.0,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``naive_scalar_gla``: q, k [T, H, K]; v [T, H, V]; g [T, H] ->
    o [T, H, V] fp32, final state [H, K, V] fp32."""
    steps, heads, dk = k.shape
    q, k, v, g = (x.float().transpose(0, 1) for x in (q, k, v, g))  # heads first: [H, T, ...]
    state = (torch.zeros(heads, dk, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float().clone())
    outputs = []
    for lo in range(0, steps, chunk_size):
        hi = min(lo + chunk_size, steps)
        qc, kc, vc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi]
        decay = g[:, lo:hi].cumsum(-1)  # [H, c] b_i
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=k.device).tril()
        gaps = torch.where(causal, decay[:, :, None] - decay[:, None, :], -torch.inf).exp()  # exp(b_i - b_j), j <= i
        scores = (qc @ kc.transpose(1, 2)) * gaps
        outputs.append(scale * (scores @ vc + (qc * decay.exp()[..., None]) @ state))
        to_end = (decay[:, -1:] - decay).exp()[..., None]  # exp(b_c - b_j)
        state = decay[:, -1].exp()[:, None, None] * state + (kc * to_end).transpose(1, 2) @ vc
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def scalar_gla_chunk_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
                          prefixes: tuple[torch.Tensor, torch.Tensor] | None = None) -> ChunkMaps:
    """Chunks q, k [N, H, C, K], v [N, H, C, V], g [N, H, C] (zero-padded) as maps of their entering
    state S (the formulas above): o = scale (q e^b) S + scale (the causal scores) v, S' = e^(b_c) S + ...
    ``prefixes`` (chunk [P], tokens n [P]): also the maps to the state after a chunk's first n tokens."""
    size = k.shape[-2]
    q, k, v, decay = q.float() * scale, k.float(), v.float(), g.float().cumsum(-1)
    to_end = (decay[..., -1:] - decay).exp()[..., None]
    maps = AffineMaps((k * to_end).transpose(-1, -2) @ v, scale=decay[..., -1].exp())
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    gaps = torch.where(causal, decay[..., :, None] - decay[..., None, :], -torch.inf).exp()
    prefix_maps = None
    if prefixes is not None:
        total, to_end = prefix_decays(decay, prefixes)
        written = (k.index_select(0, prefixes[0]) * to_end[..., None]).transpose(-1, -2) @ v.index_select(0, prefixes[0])
        prefix_maps = AffineMaps(written, scale=total.exp())
    return ChunkMaps(q * decay.exp()[..., None], (q @ k.transpose(-1, -2)) * gaps @ v, maps, prefix_maps)
