"""Token-by-token reference of gated linear attention with a gate per key channel (GLA): the oracle
for the chunked path."""
import torch


def naive_diagonal_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       initial_state: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T ;  o_t = scale * S_t^T q_t.

    q, k, g (log decay per key channel, <= 0): [T, H, K]; v: [T, H, V]; initial_state: [H, K, V].
    Returns o [T, H, V] fp32 and the final state [H, K, V] fp32.
    """
    steps, heads, dk = k.shape
    q, k, v, g = (x.float() for x in (q, k, v, g))
    state = (torch.zeros(heads, dk, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float().clone())
    out = torch.empty(steps, heads, v.shape[-1], device=k.device)
    for t in range(steps):
        state = state * g[t].exp()[:, :, None] + k[t][:, :, None] * v[t][:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, state)
    return out, state
