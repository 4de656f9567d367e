"""Chunked Kimi Delta Attention in PyTorch (CPU, and CUDA without FLA).

Within a chunk with cumulative log decay b_i = g_1 + ... + g_i per key channel, the state after
token i is S_i = diag(exp(b_i)) S_0 + sum_{j <= i} diag(exp(b_i - b_j)) k_j d_j^T, where the
written deltas d solve the unit lower-triangular system (the UT transform)
  d_i + beta_i sum_{j < i} (k_i . exp(b_i - b_j) k_j) d_j = beta_i (v_i - (k_i exp(b_i))^T S_0),
so d = U - W S_0 with U, W from one triangular solve per chunk. Across chunks the state is
carried sequentially. Every exponent formed is b_i - b_j with j <= i, b_i or b_c - b_j, never
positive (the gates are log decays, <= 0, as the clamp of the gaps to [EXP_FLOOR, 0] assumes): no
overflow whatever the gates, and exp(-b) is never formed. The c x c x K decay factors (c^2 K memory
per head) are built for a group of chunks at a time, which bounds memory on long prompts. Chunks of 8 tokens measured fastest on CPU (the factors
grow with c, the host-bound chunk loop with 1 / c).
"""
import torch
import torch.nn.functional as F

from ..affine_chain import AffineMaps
from ..dispatch import ChunkMaps, prefix_decays
from ..triangular import unit_lower_solve

GROUP_ELEMENTS = 1 << 20  # the most elements of one c x c x K factor per group of chunks (cache-sized)
EXP_FLOOR = -80.0  # exp(-80) ~ 2e-35: a normal float, far below the fp32 resolution of O(1) terms


def _chunked(x: torch.Tensor, size: int) -> torch.Tensor:
    """[..., T, D] -> [..., N, C, D] (T already padded to a multiple of C)."""
    return x.reshape(*x.shape[:-2], -1, size, x.shape[-1])


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                 beta: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-chunk factors of q (scaled), k, b (cumulative log decay) [H, N, C, K]; v [H, N, C, V];
    beta [H, N, C, 1]. Returns U [H, N, C, V], W [H, N, C, K], the decayed queries [H, N, C, K], the
    causal scores [H, N, C, C], the keys decayed to the chunk end, transposed [H, N, K, C], and the
    chunk's decay [H, N, K, 1]."""
    # exp(b_i - b_j) for j <= i; the clamp bounds j > i (zeroed after the sums) and keeps exp off its
    # slow path for huge negative inputs (e^-80 is below any fp32 output's resolution)
    gaps = (b[..., :, None, :] - b[..., None, :, :]).clamp_(EXP_FLOOR, 0.0).exp_()  # [.., i, j, K]
    # row i of (k_j * exp(b_i - b_j)) against k_i and q_i in one batched matvec
    kk, qk = ((gaps * k[..., None, :, :]) @ torch.stack([k, q], dim=-1)).unbind(-1)
    rhs = torch.cat([v * beta, k * beta * b.exp()], dim=-1)
    u, w = unit_lower_solve((kk * beta).tril(-1), rhs).split([v.shape[-1], k.shape[-1]], dim=-1)
    k_to_end = (k * (b[..., -1:, :] - b).exp()).transpose(-1, -2)
    return u, w, q * b.exp(), qk.tril(), k_to_end, b[..., -1, :, None].exp()


def _chunk_heads_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, scale: float, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g [H, T, K]; v [H, T, V]; beta [H, T]; state [H, K, V] fp32.
    Returns o [H, T, V] fp32 and the final state [H, K, V] fp32."""
    steps = k.shape[-2]
    pad = (-steps) % chunk_size  # padded tokens have k = 0 and g = 0: they leave the state alone
    g = g.float().clamp(min=EXP_FLOOR)  # a gate of -inf (a full reset) would make b_i - b_j = nan
    q, k, v, g = (_chunked(F.pad(x.float(), (0, 0, 0, pad)), chunk_size) for x in (q, k, v, g))
    beta = F.pad(beta.float(), (0, pad)).reshape(beta.shape[0], -1, chunk_size, 1)
    b, q = g.cumsum(-2), q * scale
    chunks, per_chunk = k.shape[1], k.shape[0] * chunk_size * chunk_size * k.shape[-1]
    group = max(1, GROUP_ELEMENTS // per_chunk)
    outs = []
    for lo in range(0, chunks, group):
        factors = _intra_chunk(*(x[:, lo : lo + group] for x in (q, k, v, b, beta)))
        for u_i, w_i, q_i, a_i, k_i, d_i in zip(*(f.unbind(1) for f in factors)):
            v_new = torch.baddbmm(u_i, w_i, state, alpha=-1.0)  # fused multiply-adds: the loop is host-bound
            outs.append(torch.baddbmm(q_i @ state, a_i, v_new))
            state = torch.baddbmm(state * d_i, k_i, v_new)
    return torch.stack(outs, 1).flatten(1, 2)[:, :steps], state


def chunk_kimi_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``naive_kimi_delta_rule``: q, k, g [T, H, K]; v [T, H, V]; beta [T, H];
    initial_state [H, K, V] (None: zeros). Returns o [T, H, V] fp32 and the final state [H, K, V] fp32."""
    steps, heads, dk = k.shape
    scale = dk**-0.5 if scale is None else scale
    state = (torch.zeros(heads, dk, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float())
    q, k, v, g = (x.transpose(0, 1) for x in (q, k, v, g))
    out, state = _chunk_heads_first(q, k, v, g, beta.transpose(0, 1), state, scale, chunk_size)
    return out.transpose(0, 1).contiguous(), state


def chunk_kimi_delta_rule_with_transition(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float | None = None,
    chunk_size: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``chunk_kimi_delta_rule`` that also returns the run's transition T [H, K, K]: the final state
    equals T @ initial_state plus the final state of the same run from zero.

    The rule acts on each value column alone and is linear in (state, values), so T is the final
    state from the identity under zero values: one run over [v | 0] from [initial_state | I]."""
    dv, dk = v.shape[-1], k.shape[-1]
    eye = torch.eye(dk, device=k.device).expand(k.shape[1], dk, dk)
    wide_v = torch.cat([v.float(), v.new_zeros(*v.shape[:-1], dk, dtype=torch.float32)], dim=-1)
    wide_state = torch.cat([initial_state.float(), eye], dim=-1)
    out, state = chunk_kimi_delta_rule(q, k, wide_v, g, beta, wide_state, scale, chunk_size)
    return out[..., :dv].contiguous(), state[..., :dv].contiguous(), state[..., dv:].contiguous()


def kimi_delta_chunk_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          scale: float, prefixes: tuple[torch.Tensor, torch.Tensor] | None = None) -> ChunkMaps:
    """Chunks q, k, g [N, H, C, K], v [N, H, C, V], beta [N, H, C] (zero-padded) as maps of their
    entering state S: the written deltas are u - w S, so o = (q e^b - A w) S + A u and
    S' = diag(d) S + k_end (u - w S). The c x c x K factors are formed a group of chunks at a
    time (``GROUP_ELEMENTS``), as in the chunked form. ``prefixes`` (chunk [P], tokens n [P]): also
    the maps to the state after a chunk's first n tokens (the transform is causal)."""
    g = g.float().clamp(min=EXP_FLOOR)
    b, q, k, v = g.cumsum(-2), q.float() * scale, k.float(), v.float()
    beta = beta.float()[..., None]
    per_chunk = k[:1].numel() * k.shape[-2]
    group = max(1, GROUP_ELEMENTS // max(per_chunk, 1))
    parts = [_intra_chunk(*(x[lo : lo + group] for x in (q, k, v, b, beta))) for lo in range(0, k.shape[0], group)]
    u, w, q_decayed, scores, k_to_end, decay = (torch.cat(f) if len(parts) > 1 else f[0] for f in zip(*parts))
    maps = AffineMaps(scale=decay[..., 0], left=k_to_end, right=w, values=u)
    prefix_maps = None
    if prefixes is not None:
        total, to_end = prefix_decays(b, prefixes)
        chunks = prefixes[0]
        left = (k.index_select(0, chunks) * to_end).transpose(-1, -2)
        prefix_maps = AffineMaps(scale=total.exp(), left=left, right=w.index_select(0, chunks),
                                 values=u.index_select(0, chunks))
    return ChunkMaps(q_decayed - scores @ w, scores @ u, maps, prefix_maps)
