"""Token-by-token reference of Kimi Delta Attention (the delta rule with a decay per key channel):
the oracle for the chunked paths."""
import torch


def naive_kimi_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T ;  o_t = scale * S_t^T q_t.

    q, k: [T, H, K] (already normalised); v: [T, H, V]; g (log decay per key channel, <= 0): [T, H, K];
    beta: [T, H]; initial_state: [H, K, V] (None: zeros). Returns o [T, H, V] fp32 and the final
    state [H, K, V] fp32.
    """
    steps, heads, dk = k.shape
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    state = (torch.zeros(heads, dk, v.shape[-1], device=k.device) if initial_state is None
             else initial_state.float().clone())
    out = torch.full((steps, heads, v.shape[-1]), float("nan"), device=k.device)  # a row left unwritten shows
    for t in range(steps):
        state = state * g[t].exp()[:, :, None]  # decay each key channel before the recall
        recalled = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - recalled) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t] * scale, state)
    return out, state


def naive_kimi_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """T = prod_t (I - b_t k_t k_t^T) diag(exp(g_t)), latest token leftmost: the map from a run's
    initial state to its final state less the final state from zero.
    k, g [T, H, K]; beta [T, H] -> [H, K, K] fp32."""
    steps, heads, dk = k.shape
    k, g, beta = k.float(), g.float(), beta.float()
    eye = torch.eye(dk, device=k.device)
    transition = eye.repeat(heads, 1, 1)
    for t in range(steps):
        step = eye - beta[t][:, None, None] * k[t][:, :, None] * k[t][:, None, :]
        transition = step @ (g[t].exp()[:, :, None] * transition)  # diag(exp(g_t)) scales the rows
    return transition
