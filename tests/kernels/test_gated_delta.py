"""Chunked gated delta rule and the dispatcher vs the token-by-token reference."""
import pytest
import torch
import torch.nn.functional as F

from hypic.kernels.gated_delta import SHORT_RUN, chunk_gated_delta_rule, gated_delta_rule, naive_gated_delta_rule


def _inputs(steps: int, heads: int = 3, dk: int = 16, dv: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(steps, heads, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(steps, heads, dk, generator=gen), dim=-1)
    v = torch.randn(steps, heads, dv, generator=gen)
    g = -torch.rand(steps, heads, generator=gen) * 0.2
    beta = torch.rand(steps, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(heads, dk, dv, generator=gen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("steps", [1, 5, 63, 64, 65, 200])
def test_chunk_matches_naive(steps: int) -> None:
    q, k, v, g, beta, state = _inputs(steps)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def test_padding_does_not_leak() -> None:
    """Tokens after the end (the chunk's padding) must not touch the state: poison what follows."""
    q, k, v, g, beta, state = _inputs(70)
    _, short = chunk_gated_delta_rule(q[:50], k[:50], v[:50], g[:50], beta[:50], state)
    poisoned = v.clone()
    poisoned[50:] = float("nan")
    _, again = chunk_gated_delta_rule(q[:50], k[:50], poisoned[:50], g[:50], beta[:50], state)
    assert torch.isfinite(again).all() and torch.equal(short, again)


def test_zero_start_when_no_initial_state() -> None:
    q, k, v, g, beta, _ = _inputs(40)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, torch.zeros(3, 16, 8))
    out, final = gated_delta_rule(q, k, v, g, beta)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


@pytest.mark.parametrize("steps", [SHORT_RUN - 1, SHORT_RUN, 130])
def test_dispatcher_on_cpu_matches_reference(steps: int) -> None:
    q, k, v, g, beta, state = _inputs(steps, dv=16)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def test_closed_recurrence_definition() -> None:
    """One step by hand: S1 = e^g (I - b k k^T) S0 + b k v^T, o = S1^T q / sqrt(K)."""
    q, k, v, g, beta, state = _inputs(1, heads=1)
    expected = g[0, 0].exp() * (torch.eye(16) - beta[0, 0] * torch.outer(k[0, 0], k[0, 0])) @ state[0]
    expected = expected + beta[0, 0] * torch.outer(k[0, 0], v[0, 0])
    out, final = naive_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.allclose(final[0], expected, atol=1e-6)
    assert torch.allclose(out[0, 0], expected.T @ q[0, 0] / 4.0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
def test_fla_kernel_matches_reference_on_gpu() -> None:
    q, k, v, g, beta, state = _inputs(300, dv=16)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final = gated_delta_rule(*(x.cuda() for x in (q, k, v, g, beta, state)))
    assert _rel(out.cpu(), out_ref) < 1e-3 and _rel(final.cpu(), state_ref) < 1e-3
