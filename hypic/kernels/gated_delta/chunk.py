"""Chunked gated delta rule in plain PyTorch (the CPU path; FLA's Triton kernel on GPU).

Within a chunk of C tokens the delta-rule updates are condensed by the WY/UT transform into
triangular solves and matmuls; across chunks the state is carried sequentially. The chunk
loop walks ``unbind`` views and stacks its outputs, so autograd (training) sees one
gather and one scatter instead of a full-size zero fill per chunk slice.
"""
import torch
import torch.nn.functional as F

from ..affine_chain import AffineMaps
from ..dispatch import ChunkMaps, prefix_decays
from ..triangular import unit_lower_solve


def _chunked(x: torch.Tensor, size: int) -> torch.Tensor:
    """[..., T, D] -> [..., N, C, D] (T already padded to a multiple of C)."""
    return x.reshape(*x.shape[:-2], -1, size, x.shape[-1])


def chunk_gated_delta_rule_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    transition: bool = False,
) -> tuple[torch.Tensor, ...]:
    """q, k [..., H, T, K]; v [..., H, T, V]; g, beta [..., H, T]; initial_state [..., H, K, V].

    Any leading dims (e.g. a batch) are carried through. Returns o [..., H, T, V] fp32 and
    the final state [..., H, K, V] fp32; differentiable in every input. With ``transition`` also
    the run's transition T [..., H, K, K]: final state = T @ initial state + the state from zero.
    """
    steps, dk, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    pad = (-steps) % chunk_size
    q, k, v = (_chunked(F.pad(x.float(), (0, 0, 0, pad)), chunk_size) for x in (q, k, v))
    g, beta = (F.pad(x.float(), (0, pad)) for x in (g, beta))
    g = g.reshape(*g.shape[:-1], -1, chunk_size).cumsum(-1)  # log of the decay from chunk start to t
    beta = beta.reshape(*beta.shape[:-1], -1, chunk_size, 1)
    q = q * scale
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # UT transform: (I + strictly-lower(beta K K^T * decay)) W = beta [V | K exp(g)]
    lower = ((k * beta) @ k.transpose(-1, -2) * decay).tril(-1)
    rhs = torch.cat([v * beta, k * beta * g.exp()[..., None]], dim=-1)
    solved = unit_lower_solve(lower, rhs)
    u, w = solved.split([dv, dk], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * g.exp()[..., None]
    k_to_end = (k * (g[..., -1:] - g).exp()[..., None]).transpose(-1, -2)
    chunk_decay = g[..., -1].exp()[..., None, None]
    state_shape = (*k.shape[:-3], dk, dv)
    state = (torch.zeros(state_shape, device=k.device) if initial_state is None
             else initial_state.float())
    outs = []
    per_chunk = (x.unbind(-3) for x in (u, w, q_decayed, attn, k_to_end))
    for (u_i, w_i, q_i, a_i, k_i), d_i in zip(zip(*per_chunk), chunk_decay.unbind(-3)):
        v_new = u_i - w_i @ state
        outs.append(q_i @ state + a_i @ v_new)
        state = state * d_i + k_i @ v_new
    out = torch.stack(outs, -3).flatten(-3, -2)[..., :steps, :]
    if not transition:
        return out, state
    # chunk i maps S to (d_i I - k_i w_i) S + (the chunk's own writes): chain those maps
    carried = torch.eye(dk, device=k.device).expand(*state_shape[:-1], dk)
    for chunk_map in (chunk_decay * torch.eye(dk, device=k.device) - k_to_end @ w).unbind(-3):
        carried = chunk_map @ carried
    return out, state, carried


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``naive_gated_delta_rule``: q, k [T, H, K]; v [T, H, V]; g, beta [T, H];
    initial_state [H, K, V]. Returns o [T, H, V] fp32 and the final state [H, K, V] fp32."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    state = None if initial_state is None else initial_state.clone()
    out, state = chunk_gated_delta_rule_heads_first(q, k, v, g, beta, state, scale, chunk_size)
    return out.transpose(0, 1).contiguous(), state


def chunk_gated_delta_rule_with_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                           beta: torch.Tensor, initial_state: torch.Tensor, scale: float | None = None,
                                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk_gated_delta_rule`` that also returns the run's transition T [H, K, K]: the final
    state equals T @ initial_state plus the final state of the same run from zero."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    out, state, transition = chunk_gated_delta_rule_heads_first(
        q, k, v, g.transpose(0, 1), beta.transpose(0, 1), initial_state.clone(), scale, chunk_size, transition=True)
    return out.transpose(0, 1).contiguous(), state, transition


def gated_delta_chunk_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float, prefixes: tuple[torch.Tensor, torch.Tensor] | None = None) -> ChunkMaps:
    """Chunks q, k [N, H, C, K], v [N, H, C, V], g, beta [N, H, C] (zero-padded) as maps of their
    entering state S (the chunked form above, linear in S): with the UT transform's u and w, the
    written values are u - w S, so o = (q_decayed - A w) S + A u and S' = d S + k_end (u - w S).
    ``prefixes`` (chunk [P], tokens n [P]): also the maps to the state after a chunk's first n tokens,
    from the same u and w (the transform is causal: a prefix's rows are the chunk's)."""
    size, dk = k.shape[-2], k.shape[-1]
    q, k, v = (x.float() for x in (q, k, v))
    g, beta = g.float().cumsum(-1), beta.float()[..., None]
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    written = k * beta
    lower = (written @ k.transpose(-1, -2) * decay).tril(-1)
    rhs = torch.cat([v * beta, written * g.exp()[..., None]], dim=-1)
    u, w = unit_lower_solve(lower, rhs).split([v.shape[-1], dk], -1)
    k_to_end = (k * (g[..., -1:] - g).exp()[..., None]).transpose(-1, -2)
    maps = AffineMaps(scale=g[..., -1].exp(), left=k_to_end, right=w, values=u)
    attn = (q @ k.transpose(-1, -2)) * decay * scale
    return ChunkMaps(q * (g.exp()[..., None] * scale) - attn @ w, attn @ u, maps, _prefix_maps(k, g, u, w, prefixes))


def _prefix_maps(k: torch.Tensor, g: torch.Tensor, u: torch.Tensor, w: torch.Tensor,
                 prefixes: tuple[torch.Tensor, torch.Tensor] | None) -> AffineMaps | None:
    if prefixes is None:
        return None
    total, to_end = prefix_decays(g, prefixes)
    chunks = prefixes[0]
    left = (k.index_select(0, chunks) * to_end[..., None]).transpose(-1, -2)
    return AffineMaps(scale=total.exp(), left=left, right=w.index_select(0, chunks), values=u.index_select(0, chunks))
