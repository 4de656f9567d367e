"""Scalar-gated linear attention: the chunked form and the dispatcher against the token loop, and
the token loop against the closed-form attention sum."""
import pytest
import torch

from hypic.kernels.scalar_gla import SHORT_RUN, chunk_scalar_gla, naive_scalar_gla, scalar_gla


def _inputs(steps: int, heads: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(steps, heads, dk, generator=gen), torch.randn(steps, heads, dk, generator=gen)
    v = torch.randn(steps, heads, dv, generator=gen)
    g = -torch.rand(steps, heads, generator=gen) * 0.3
    return q, k, v, g, torch.randn(heads, dk, dv, generator=gen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_token_loop_is_the_attention_sum() -> None:
    """o_t = scale (exp(b_t) q_t S_0 + sum_{j<=t} exp(b_t - b_j) (q_t . k_j) v_j), b the cumulative log decay."""
    q, k, v, g, state = _inputs(9)
    b = g.cumsum(0)  # [T, H]
    out, final = naive_scalar_gla(q, k, v, g, state, scale=0.5)
    for t in range(9):
        for h in range(3):
            expected = b[t, h].exp() * q[t, h] @ state[h]
            for j in range(t + 1):
                expected = expected + (b[t, h] - b[j, h]).exp() * (q[t, h] @ k[j, h]) * v[j, h]
            torch.testing.assert_close(out[t, h], 0.5 * expected, rtol=1e-5, atol=1e-5)
    from_zero = naive_scalar_gla(q, k, v, g, None)[1]
    torch.testing.assert_close(final, b[-1].exp()[:, None, None] * state + from_zero)  # T_C = prod of the gates


@pytest.mark.parametrize("steps", [1, 5, 31, 32, 33, 100])
@pytest.mark.parametrize("chunk_size", [8, 32, 64])
def test_chunk_matches_the_token_loop(steps: int, chunk_size: int) -> None:
    q, k, v, g, state = _inputs(steps)
    out_ref, state_ref = naive_scalar_gla(q, k, v, g, state, scale=0.25)
    out, final = chunk_scalar_gla(q, k, v, g, state, scale=0.25, chunk_size=chunk_size)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def test_strong_decay_does_not_overflow() -> None:
    """exp(b_i - b_j) is only formed for j <= i: a chunk whose gates sum to -2000 stays finite."""
    q, k, v, _, state = _inputs(64)
    g = torch.full((64, 3), -30.0)
    out, final = chunk_scalar_gla(q, k, v, g, state, chunk_size=64)
    out_ref, state_ref = naive_scalar_gla(q, k, v, g, state)
    assert torch.isfinite(out).all() and _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


@pytest.mark.parametrize("steps", [SHORT_RUN - 1, SHORT_RUN, 77])
def test_dispatcher_matches_the_token_loop(steps: int) -> None:
    q, k, v, g, state = _inputs(steps, seed=3)
    out_ref, state_ref = naive_scalar_gla(q, k, v, g, state)
    out, final = scalar_gla(q, k, v, g, state)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5
