"""Gated linear attention with per-channel gates: the chunked form and the dispatcher against the
token loop, and the token loop against the closed-form sum."""
import pytest
import torch

from hypic.kernels.diagonal_gla import SHORT_RUN, chunk_diagonal_gla, diagonal_gla, naive_diagonal_gla


def _inputs(steps: int, heads: int = 3, dk: int = 16, dv: int = 8, seed: int = 0, strength: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(steps, heads, dk, generator=gen), torch.randn(steps, heads, dk, generator=gen)
    v = torch.randn(steps, heads, dv, generator=gen)
    g = -torch.rand(steps, heads, dk, generator=gen) * strength
    return q, k, v, g, torch.randn(heads, dk, dv, generator=gen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_token_loop_is_the_closed_form_sum() -> None:
    """o_t = scale sum_d q_td (exp(b_td) S_0[d] + sum_{j<=t} exp(b_td - b_jd) k_jd v_j)."""
    q, k, v, g, state = _inputs(7)
    b = g.cumsum(0)
    out, final = naive_diagonal_gla(q, k, v, g, state, scale=0.5)
    for t in range(7):
        for h in range(3):
            expected = (q[t, h] * b[t, h].exp()) @ state[h]
            for j in range(t + 1):
                expected = expected + ((q[t, h] * k[j, h] * (b[t, h] - b[j, h]).exp()).sum()) * v[j, h]
            torch.testing.assert_close(out[t, h], 0.5 * expected, rtol=1e-5, atol=1e-5)
    from_zero = naive_diagonal_gla(q, k, v, g)[1]
    torch.testing.assert_close(final, b[-1].exp()[:, :, None] * state + from_zero)  # T_C = diag(prod of gates)


@pytest.mark.parametrize("steps", [1, 5, 15, 16, 17, 70])
@pytest.mark.parametrize("chunk_size", [4, 16, 32])
def test_chunk_matches_the_token_loop(steps: int, chunk_size: int) -> None:
    q, k, v, g, state = _inputs(steps)
    out_ref, state_ref = naive_diagonal_gla(q, k, v, g, state, scale=0.25)
    out, final = chunk_diagonal_gla(q, k, v, g, state, scale=0.25, chunk_size=chunk_size)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def test_strong_gates_do_not_overflow() -> None:
    q, k, v, g, state = _inputs(32, strength=40.0)
    out, final = chunk_diagonal_gla(q, k, v, g, state, chunk_size=32)
    out_ref, state_ref = naive_diagonal_gla(q, k, v, g, state)
    assert torch.isfinite(out).all() and _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


@pytest.mark.parametrize("steps", [SHORT_RUN - 1, 50])
def test_dispatcher_matches_the_token_loop(steps: int) -> None:
    q, k, v, g, state = _inputs(steps, seed=2)
    out_ref, state_ref = naive_diagonal_gla(q, k, v, g, state)
    out, final = diagonal_gla(q, k, v, g, state)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5
