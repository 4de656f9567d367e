"""Token-by-token reference of the gated delta rule: the oracle for the chunked paths."""
import torch


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T ;  o_t = scale * S_t^T q_t.

    q, k: [T, H, K] (already normalised, already expanded to the value heads);
    v: [T, H, V]; g (log decay), beta: [T, H]; initial_state: [H, K, V] fp32.
    Returns o [T, H, V] fp32 and the final state [H, K, V] fp32.
    """
    steps, heads, dk = k.shape
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = (torch.zeros(heads, dk, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float().clone())
    out = torch.empty(steps, heads, v.shape[-1], device=k.device)
    for t in range(steps):
        state = state * g[t].exp()[:, None, None]
        recalled = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - recalled) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, state)
    return out, state


def naive_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """T = prod_t exp(g_t) (I - b_t k_t k_t^T), latest token leftmost: the map from a run's initial
    state to its final state less the final state from zero. k [T, H, K]; g, beta [T, H] -> [H, K, K]."""
    steps, heads, dk = k.shape
    k, g, beta = k.float(), g.float(), beta.float()
    transition = torch.eye(dk, device=k.device).repeat(heads, 1, 1)
    for t in range(steps):
        step = torch.eye(dk, device=k.device) - beta[t][:, None, None] * k[t][:, :, None] * k[t][:, None, :]
        transition = g[t].exp()[:, None, None] * step @ transition
    return transition
