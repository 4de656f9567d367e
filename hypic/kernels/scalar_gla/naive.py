"""Token-by-token reference of linear attention with a scalar gate per head: the oracle for the
chunked path (Lightning attention, RetNet, Mamba2's SSM in its attention form)."""
import torch


def naive_scalar_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = exp(g_t) S_{t-1} + k_t v_t^T ;  o_t = scale * S_t^T q_t.

    q, k: [T, H, K]; v: [T, H, V]; g (log decay, <= 0): [T, H]; initial_state: [H, K, V].
    Returns o [T, H, V] fp32 and the final state [H, K, V] fp32.
    """
    steps, heads, dk = k.shape
    q, k, v, g = (x.float() for x in (q, k, v, g))
    state = (torch.zeros(heads, dk, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float().clone())
    out = torch.empty(steps, heads, v.shape[-1], device=k.device)
    for t in range(steps):
        state = state * g[t].exp()[:, None, None] + k[t][:, :, None] * v[t][:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, state)
    return out, state
