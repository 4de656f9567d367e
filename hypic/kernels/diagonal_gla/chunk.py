"""Chunked GLA in PyTorch (CPU, and CUDA without FLA): within a chunk with cumulative log decay
b_i = g_1 + ... + g_i per key channel,
  o_i = scale * sum_d q_id (exp(b_id) S_0[d] + sum_{j <= i} exp(b_id - b_jd) k_jd v_j)
  S_c = diag(exp(b_c)) S_0 + sum_j diag(exp(b_c - b_j)) k_j v_j^T.
The c x c x K decay factors are formed only for j <= i, where every exponent is <= 0: no overflow
whatever the gates (the price is c^2 K memory per head, small for the chunk sizes used here)."""
import torch

from ..affine_chain import AffineMaps
from ..dispatch import ChunkMaps, prefix_decays


def chunk_diagonal_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       initial_state: torch.Tensor | None = None, scale: float = 1.0,
                       chunk_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``naive_diagonal_gla``."""
    steps, heads, dk = k.shape
    q, k, v, g = (x.float().transpose(0, 1) for x in (q, k, v, g))  # [H, T, ...]
    state = (torch.zeros(heads, dk, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float().clone())
    outputs = []
    for lo in range(0, steps, chunk_size):
        hi = min(lo + chunk_size, steps)
        qc, kc, vc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi]
        decay = g[:, lo:hi].cumsum(1)  # [H, c, K]
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=k.device).tril()[None, :, :, None]
        gaps = torch.where(causal, decay[:, :, None] - decay[:, None], -torch.inf).exp()  # [H, i, j, K]
        scores = torch.einsum("hik,hjk,hijk->hij", qc, kc, gaps)
        outputs.append(scale * (scores @ vc + (qc * decay.exp()) @ state))
        to_end = (decay[:, -1:] - decay).exp()  # [H, c, K]
        state = decay[:, -1].exp()[:, :, None] * state + (kc * to_end).transpose(1, 2) @ vc
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def diagonal_gla_chunk_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
                            prefixes: tuple[torch.Tensor, torch.Tensor] | None = None) -> ChunkMaps:
    """Chunks q, k, g [N, H, C, K], v [N, H, C, V] (zero-padded) as maps of their entering state S
    (the formulas above): o = scale (q e^b) S + scale (the causal scores) v, S' = diag(e^(b_c)) S + ...
    ``prefixes`` (chunk [P], tokens n [P]): also the maps to the state after a chunk's first n tokens."""
    size = k.shape[-2]
    q, k, v, decay = q.float() * scale, k.float(), v.float(), g.float().cumsum(-2)
    to_end = (decay[..., -1:, :] - decay).exp()
    maps = AffineMaps((k * to_end).transpose(-1, -2) @ v, scale=decay[..., -1, :].exp())
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()[..., None]
    gaps = torch.where(causal, decay[..., :, None, :] - decay[..., None, :, :], -torch.inf).exp()
    scores = torch.einsum("...ik,...jk,...ijk->...ij", q, k, gaps)
    prefix_maps = None
    if prefixes is not None:
        total, to_end = prefix_decays(decay, prefixes)
        written = (k.index_select(0, prefixes[0]) * to_end).transpose(-1, -2) @ v.index_select(0, prefixes[0])
        prefix_maps = AffineMaps(written, scale=total.exp())
    return ChunkMaps(q * decay.exp(), scores @ v, maps, prefix_maps)
