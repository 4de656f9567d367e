"""Linear-attention algebra vs naive recurrences: composition (eq. 6), transitions, Table 2."""
import math

import pytest
import torch
import torch.nn.functional as F

from hypic.cache.composition import (Family, Transition, compose_states, diagonal_transition, naive_addition,
                                     scalar_transition)
from hypic.kernels.gated_delta import gated_delta_rule, naive_gated_delta_rule


def delta_rule_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> Transition:
    """Dense T_C = prod_t exp(g_t)(I - b_t k_t k_t^T) of the gated delta rule, from the same kernel:
    start from the identity with the written values zeroed. k [T, H, K]; g, beta [T, H]."""
    steps, heads, dk = k.shape
    start = torch.eye(dk, device=k.device).expand(heads, dk, dk).contiguous()
    _, value = gated_delta_rule(k, k, torch.zeros(steps, heads, dk, device=k.device), g, beta, start)
    return Transition(Family.DENSE, value)


def _decayed_recurrence(log_decay: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """Scalar/diagonal family by the token loop: S_t = diag(exp(log_decay_t)) S_{t-1} + k_t v_t^T.
    log_decay [T, H] or [T, H, K]; k [T, H, K]; v [T, H, V]; state [H, K, V]."""
    for t in range(k.shape[0]):
        decay = log_decay[t].exp()
        decay = decay[:, None, None] if decay.dim() == 1 else decay[:, :, None]
        state = decay * state + k[t][:, :, None] * v[t][:, None, :]
    return state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", ["scalar", "diagonal"])
def test_closed_form_composition_matches_recurrence(family: str) -> None:
    gen = torch.Generator().manual_seed(1)
    lengths, heads, dk, dv = [37, 5, 80, 21], 2, 8, 4
    total = sum(lengths)
    shape = (total, heads) if family == "scalar" else (total, heads, dk)
    log_decay = -0.05 * torch.rand(shape, generator=gen)
    k, v = torch.randn(total, heads, dk, generator=gen), torch.randn(total, heads, dv, generator=gen)
    prefix = torch.randn(heads, dk, dv, generator=gen)
    closed = scalar_transition if family == "scalar" else diagonal_transition
    segments, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        zero = _decayed_recurrence(log_decay[part], k[part], v[part], torch.zeros(heads, dk, dv))
        segments.append((closed(log_decay[part]), zero))
        start += n
    full = _decayed_recurrence(log_decay, k, v, prefix)
    assert _rel(compose_states(prefix, segments), full) < 1e-5


def test_dense_transition_is_product_of_token_transitions() -> None:
    gen = torch.Generator().manual_seed(2)
    steps, heads, dk = 12, 2, 6
    k = F.normalize(torch.randn(steps, heads, dk, generator=gen), dim=-1)
    g, beta = -0.1 * torch.rand(steps, heads, generator=gen), torch.rand(steps, heads, generator=gen)
    expected = torch.eye(dk).repeat(heads, 1, 1)
    for t in range(steps):
        step = torch.stack([g[t, h].exp() * (torch.eye(dk) - beta[t, h] * torch.outer(k[t, h], k[t, h]))
                            for h in range(heads)])
        expected = step @ expected
    assert torch.allclose(delta_rule_transition(k, g, beta).value, expected, atol=1e-6)


def test_dense_composition_matches_full_recurrence() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths, heads, dk, dv = [70, 9, 130, 33], 4, 16, 8
    total = sum(lengths)
    q = F.normalize(torch.randn(total, heads, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(total, heads, dk, generator=gen), dim=-1)
    v, prefix = torch.randn(total, heads, dv, generator=gen), torch.randn(heads, dk, dv, generator=gen)
    g, beta = -0.02 * torch.rand(total, heads, generator=gen), torch.rand(total, heads, generator=gen)
    segments, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        segments.append((delta_rule_transition(k[s], g[s], beta[s]), naive_gated_delta_rule(q[s], k[s], v[s], g[s], beta[s])[1]))
        start += n
    _, full = naive_gated_delta_rule(q, k, v, g, beta, prefix)
    assert _rel(compose_states(prefix, segments), full) < 1e-5
    assert _rel(naive_addition(prefix, segments), full) > 0.1  # the baseline's structural error


def test_transition_chaining_matches_sequential_application() -> None:
    gen = torch.Generator().manual_seed(4)
    first, second = Transition(Family.DENSE, torch.randn(2, 5, 5, generator=gen)), Transition(Family.DENSE, torch.randn(2, 5, 5, generator=gen))
    state = torch.randn(2, 5, 3, generator=gen)
    assert torch.allclose(first.then(second).apply(state), second.apply(first.apply(state)), atol=1e-5)
    with pytest.raises(ValueError, match="cannot chain"):
        first.then(Transition(Family.SCALAR, torch.ones(2)))


PAPER_TABLE_2 = {  # ||Delta|| / ||S_C1|0|| for RetNet, decay gamma x suffix length |C2|
    1 - 2**-5: (1.000, 1.000, 1.000),
    1 - 2**-7: (0.866, 0.982, 1.000),
    1 - 2**-10: (0.221, 0.394, 0.632),
}


@pytest.mark.parametrize("gamma", sorted(PAPER_TABLE_2))
def test_retnet_naive_addition_error_reproduces_table_2(gamma: float) -> None:
    """Run RetNet's recurrence for C1 then C2, compose naively, and measure the error vs the truth."""
    gen = torch.Generator().manual_seed(5)
    heads, dk, dv = 1, 8, 8
    c1_k, c1_v = torch.randn(64, heads, dk, generator=gen), torch.randn(64, heads, dv, generator=gen)
    log_gamma = math.log(gamma)
    s_c1 = _decayed_recurrence(torch.full((64, heads), log_gamma), c1_k, c1_v, torch.zeros(heads, dk, dv))
    for length, expected in zip((256, 512, 1024), PAPER_TABLE_2[gamma]):
        k, v = torch.randn(length, heads, dk, generator=gen), torch.randn(length, heads, dv, generator=gen)
        log_decay = torch.full((length, heads), log_gamma, dtype=torch.float64)
        s_c2 = _decayed_recurrence(log_decay.float(), k, v, torch.zeros(heads, dk, dv))
        truth = _decayed_recurrence(log_decay.float(), k, v, s_c1)
        segments = [(scalar_transition(log_decay), s_c2)]
        error = (naive_addition(s_c1, segments) - truth).norm() / s_c1.norm()
        assert round(error.item(), 3) == expected
        assert _rel(compose_states(s_c1, segments), truth) < 1e-5


class _CallLog(torch.overrides.TorchFunctionMode):
    """Records the name of every torch function called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family, shape", [(Family.SCALAR, (4,)), (Family.DIAGONAL, (4, 8))])
def test_scalar_and_diagonal_transitions_compose_elementwise(family: Family, shape: tuple[int, ...]) -> None:
    """Applying and chaining a scalar or diagonal T_C is elementwise work: no matmul of any kind."""
    state, zero = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    transition = Transition(family, torch.rand(shape))
    with _CallLog() as log:
        compose_states(state, [(transition, zero), (transition.then(transition), zero)])
    assert log.names and not {n for n in log.names if any(m in n for m in ("matmul", "bmm", "mm", "einsum"))}
    with _CallLog() as log:  # the log does see a dense transition's matmul
        Transition(Family.DENSE, torch.rand(4, 8, 8)).apply(state)
    assert any("matmul" in n for n in log.names)
