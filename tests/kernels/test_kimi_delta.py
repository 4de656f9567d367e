"""Kimi Delta Attention: the chunked form, its transition, the decode step and the dispatcher against
the token loop, and the token loop against transformers' own recurrent implementation."""
import inspect
import sys

import pytest
import torch
import torch.nn.functional as F

from hypic.kernels.kimi_delta import (SHORT_RUN, chunk_kimi_delta_rule, chunk_kimi_delta_rule_with_transition,
                                     kimi_delta_rule, kimi_delta_rule_with_transition, kimi_delta_step,
                                     naive_kimi_delta_rule, naive_kimi_transition)


def _inputs(steps: int, heads: int = 3, dk: int = 16, dv: int = 8, seed: int = 0, strength: float = 0.3):
    """q, k (unit rows), v, g (log decay per key channel, mean -strength), beta, a random state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(steps, heads, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(steps, heads, dk, generator=gen), dim=-1)
    v = torch.randn(steps, heads, dv, generator=gen)
    g = -torch.rand(steps, heads, dk, generator=gen) * 2 * strength
    beta = torch.rand(steps, heads, generator=gen)
    return q, k, v, g, beta, torch.randn(heads, dk, dv, generator=gen)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()  # NaN anywhere makes every `< tol` check fail


@pytest.mark.parametrize("steps", [1, 3, 17, 64, 300])
@pytest.mark.parametrize("strength", [0.02, 5.0])
@pytest.mark.parametrize("carried", [True, False])
def test_chunk_matches_naive(steps: int, strength: float, carried: bool) -> None:
    q, k, v, g, beta, state = _inputs(steps, strength=strength)
    state = state if carried else None
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, state)
    out, final = chunk_kimi_delta_rule(q, k, v, g, beta, state)
    assert torch.isfinite(out_ref).all()  # the token loop writes every row of its NaN-filled output
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


@pytest.mark.parametrize("chunk_size", [4, 8, 16, 32])
@pytest.mark.parametrize("steps", [15, 16, 70])
def test_every_chunk_size_matches_naive(chunk_size: int, steps: int) -> None:
    q, k, v, g, beta, state = _inputs(steps, seed=1)
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, state, scale=0.5)
    out, final = chunk_kimi_delta_rule(q, k, v, g, beta, state, scale=0.5, chunk_size=chunk_size)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def test_extreme_gates_stay_finite() -> None:
    """Channels that never decay next to channels reset outright (-inf) or by -40 a step."""
    q, k, v, g, beta, state = _inputs(100, strength=40.0, seed=2)
    g[:, :, :4] = 0.0
    g[::7, :, 4:8] = float("-inf")
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, state)
    out, final = chunk_kimi_delta_rule(q, k, v, g, beta, state, chunk_size=32)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def test_chunk_gradients_match_naive() -> None:
    """The chunked form is differentiable in every input (no in-place edits of saved tensors)."""
    grads = []
    for rule in (naive_kimi_delta_rule, chunk_kimi_delta_rule):
        leaves = [x.clone().requires_grad_() for x in _inputs(37, strength=1.0)]
        out, final = rule(*leaves)
        (out.square().sum() + final.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for ours, ref in zip(grads[1], grads[0]):
        assert _rel(ours, ref) < 1e-5


def test_future_tokens_do_not_leak() -> None:
    """Outputs are causal: huge values after token 50 (inside its chunk) leave the first 50 alone."""
    q, k, v, g, beta, state = _inputs(70)
    short, _ = chunk_kimi_delta_rule(q[:50], k[:50], v[:50], g[:50], beta[:50], state, chunk_size=32)
    poisoned = v.clone()
    poisoned[50:] = 1e6
    out, _ = chunk_kimi_delta_rule(q, k, poisoned, g, beta, state, chunk_size=32)
    assert _rel(out[:50], short) < 1e-5


def test_closed_recurrence_definition() -> None:
    """One step by hand: S1 = (I - b k k^T) diag(e^g) S0 + b k v^T, o = S1^T q / sqrt(K)."""
    q, k, v, g, beta, state = _inputs(1, heads=1)
    b, kt = beta[0, 0], k[0, 0]
    expected = (torch.eye(16) - b * torch.outer(kt, kt)) @ torch.diag(g[0, 0].exp()) @ state[0]
    expected = expected + b * torch.outer(kt, v[0, 0])
    out, final = naive_kimi_delta_rule(q, k, v, g, beta, state)
    assert torch.allclose(final[0], expected, atol=1e-6)
    assert torch.allclose(out[0, 0], expected.T @ q[0, 0] / 4.0, atol=1e-6)


def test_naive_transition_is_the_map_of_initial_states() -> None:
    """The rule is affine in its initial state: final(S0) - final(0) = T S0 for any S0."""
    q, k, v, g, beta, state = _inputs(30, strength=0.05)
    transition = naive_kimi_transition(k, g, beta)
    from_state = naive_kimi_delta_rule(q, k, v, g, beta, state)[1]
    from_zero = naive_kimi_delta_rule(q, k, v, g, beta)[1]
    assert transition.norm() > 0.1 and _rel(transition @ state, from_state - from_zero) < 1e-5


@pytest.mark.parametrize(("steps", "chunk_size"), [(1, 4), (5, 4), (33, 8), (70, 16), (200, 32)])
def test_chunk_transition_matches_naive(steps: int, chunk_size: int) -> None:
    q, k, v, g, beta, state = _inputs(steps, strength=0.01)
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, state)
    out, final, transition = chunk_kimi_delta_rule_with_transition(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5
    assert transition.norm() > 1e-3 and _rel(transition, naive_kimi_transition(k, g, beta)) < 1e-5
    from_zero = chunk_kimi_delta_rule(q, k, v, g, beta, chunk_size=chunk_size)[1]
    assert _rel(transition @ state + from_zero, final) < 1e-5


def test_step_matches_one_naive_step_per_request() -> None:
    """A batch of 4 requests, each with its own state and token, through one batched step."""
    requests = [_inputs(1, seed=s) for s in range(4)]
    q, k, v, g, beta = (torch.stack([r[i][0] for r in requests]) for i in range(5))
    states = torch.stack([r[5] for r in requests])
    out, new_states = kimi_delta_step(states, q, k, v, g, beta)
    for b, request in enumerate(requests):
        out_ref, state_ref = naive_kimi_delta_rule(*request)
        assert _rel(out[b], out_ref[0]) < 1e-6 and _rel(new_states[b], state_ref) < 1e-6


@pytest.mark.parametrize("steps", [1, SHORT_RUN - 1, SHORT_RUN, 130])
def test_dispatcher_on_cpu_matches_reference(steps: int) -> None:
    q, k, v, g, beta, state = _inputs(steps, dv=16, strength=0.05)
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, state)
    out, final = kimi_delta_rule(q, k, v, g, beta, state)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5
    out, final, transition = kimi_delta_rule_with_transition(q, k, v, g, beta, state)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5
    assert _rel(transition, naive_kimi_transition(k, g, beta)) < 1e-5


def test_zero_start_and_fp32_results_from_bf16() -> None:
    q, k, v, g, beta, _ = (x.bfloat16() for x in _inputs(40))
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, torch.zeros(3, 16, 8))
    out, final = kimi_delta_rule(q, k, v, g, beta)
    assert out.dtype == final.dtype == torch.float32
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def _transformers_recurrent():
    """transformers' own token loop for Kimi Delta Attention (FLA hidden so the module imports on CPU;
    with FLA already bound, unwrap to transformers' code)."""
    sys.modules.setdefault("fla", None)
    from transformers.models.kimi_linear import modeling_kimi_linear
    return inspect.unwrap(modeling_kimi_linear.recurrent_kimi_delta_attention)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # transformers' (and FLA's) epsilon


@pytest.mark.parametrize("steps", [1, 9, 70])
@pytest.mark.parametrize("strength", [0.05, 3.0])
def test_naive_and_chunk_match_transformers(steps: int, strength: float) -> None:
    """Layout [B, T, H, *] with raw q, k (transformers normalises them in-kernel) and a state per item."""
    gen = torch.Generator().manual_seed(steps)
    q, k = torch.randn(2, steps, 3, 16, generator=gen), torch.randn(2, steps, 3, 16, generator=gen)
    v = torch.randn(2, steps, 3, 8, generator=gen)
    g = -torch.rand(2, steps, 3, 16, generator=gen) * 2 * strength
    beta, state = torch.rand(2, steps, 3, generator=gen), torch.randn(2, 3, 16, 8, generator=gen)
    out_ref, state_ref = _transformers_recurrent()(q, k, v, g, beta, initial_state=state.clone(),
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    for b in range(2):
        inputs = (_l2norm(q[b]), _l2norm(k[b]), v[b], g[b], beta[b], state[b])
        for rule in (naive_kimi_delta_rule, chunk_kimi_delta_rule):
            out, final = rule(*inputs)
            assert _rel(out, out_ref[b]) < 1e-5 and _rel(final, state_ref[b]) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
@pytest.mark.parametrize("carried", [True, False])
def test_fla_kernel_matches_reference_on_gpu(carried: bool) -> None:
    q, k, v, g, beta, state = _inputs(300, dv=16)
    state = state if carried else None
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, state)
    cuda = lambda x: None if x is None else x.cuda()  # noqa: E731
    out, final = kimi_delta_rule(*(cuda(x) for x in (q, k, v, g, beta, state)))
    assert _rel(out.cpu(), out_ref) < 5e-3 and _rel(final.cpu(), state_ref) < 5e-3  # tf32 dots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
def test_gpu_dispatch_with_transition_matches_reference() -> None:
    q, k, v, g, beta, state = _inputs(150, dv=16, strength=0.01)
    out_ref, state_ref = naive_kimi_delta_rule(q, k, v, g, beta, state)
    out, final, transition = kimi_delta_rule_with_transition(*(x.cuda() for x in (q, k, v, g, beta, state)))
    assert _rel(out.cpu(), out_ref) < 5e-3 and _rel(final.cpu(), state_ref) < 5e-3
    assert _rel(transition.cpu(), naive_kimi_transition(k, g, beta)) < 5e-3
