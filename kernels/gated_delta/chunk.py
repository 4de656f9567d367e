"""Chunked gated delta rule in plain PyTorch (the CPU path; FLA's Triton kernel on GPU).

Within a chunk of C tokens the delta-rule updates are condensed by the WY/UT transform into
triangular solves and matmuls; across chunks the state is carried sequentially.
"""
import torch
import torch.nn.functional as F


def _chunked(x: torch.Tensor, size: int) -> torch.Tensor:
    """[H, T, D] -> [H, N, C, D] (T already padded to a multiple of C)."""
    return x.reshape(x.shape[0], -1, size, x.shape[-1])


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
    steps, heads, dk = k.shape
    scale = dk**-0.5 if scale is None else scale
    pad = (-steps) % chunk_size
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(0, 1), (0, pad)) for x in (g, beta))
    q, k, v = _chunked(q * scale, chunk_size), _chunked(k, chunk_size), _chunked(v, chunk_size)
    g = g.reshape(heads, -1, chunk_size).cumsum(-1)  # log of the decay from chunk start to t
    beta = beta.reshape(heads, -1, chunk_size, 1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # UT transform: (I + strictly-lower(beta K K^T * decay)) W = beta [V | K exp(g)]
    system = ((k * beta) @ k.transpose(-1, -2) * decay).tril(-1) + torch.eye(chunk_size)
    rhs = torch.cat([v * beta, k * beta * g.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], dk], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * g.exp()[..., None]
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]
    state = torch.zeros(heads, dk, v.shape[-1]) if initial_state is None else initial_state.float().clone()
    out = torch.empty_like(u)
    for i in range(u.shape[1]):
        v_new = u[:, i] - w[:, i] @ state
        out[:, i] = q_decayed[:, i] @ state + attn[:, i] @ v_new
        state = state * g[:, i, -1].exp()[:, None, None] + k_to_end[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, v.shape[-1])[:, :steps].transpose(0, 1)
    return out.contiguous(), state
