"""Chunked gated delta rule and the dispatcher vs the token-by-token reference."""
import pytest
import torch
import torch.nn.functional as F

from hypic.kernels.dispatch import run_bounds
from hypic.kernels.gated_delta import (SHORT_RUN, chunk_gated_delta_rule, chunk_gated_delta_rule_heads_first,
                                      chunk_gated_delta_rule_with_transition, gated_delta_rule,
                                      gated_delta_rule_varlen,
                                      gated_delta_rule_with_transition, naive_gated_delta_rule, naive_transition)
from hypic.kernels.gated_delta.transformers_layout import (fla_transformers_chunk_gated_delta_rule,
                                                          transformers_chunk_gated_delta_rule)


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


@pytest.mark.parametrize("chunk_size", [4, 8, 16, 32])
def test_every_chunk_size_matches_naive(chunk_size: int) -> None:
    q, k, v, g, beta, state = _inputs(70)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5


def test_naive_transition_is_the_map_of_initial_states() -> None:
    """The rule is affine in its initial state: final(S0) - final(0) = T S0 for any S0."""
    q, k, v, g, beta, state = _inputs(30)
    transition = naive_transition(k, g, beta)
    from_state = naive_gated_delta_rule(q, k, v, g, beta, state)[1]
    from_zero = naive_gated_delta_rule(q, k, v, g, beta, torch.zeros_like(state))[1]
    assert _rel(transition @ state, from_state - from_zero) < 1e-5


@pytest.mark.parametrize(("steps", "chunk_size"), [(1, 4), (5, 4), (31, 32), (33, 32), (200, 8), (200, 64)])
def test_chunk_transition_matches_naive(steps: int, chunk_size: int) -> None:
    q, k, v, g, beta, state = _inputs(steps)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final, transition = chunk_gated_delta_rule_with_transition(q, k, v, g, beta, state, chunk_size=chunk_size)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5
    assert _rel(transition, naive_transition(k, g, beta)) < 1e-5


@pytest.mark.parametrize("steps", [1, SHORT_RUN - 1, SHORT_RUN, 130])
def test_dispatcher_with_transition_on_cpu_matches_reference(steps: int) -> None:
    q, k, v, g, beta, state = _inputs(steps, dv=16)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final, transition = gated_delta_rule_with_transition(q, k, v, g, beta, state)
    assert _rel(out, out_ref) < 1e-5 and _rel(final, state_ref) < 1e-5
    assert _rel(transition, naive_transition(k, g, beta)) < 1e-5


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


def _varlen_case(lengths: list[int], seed: int = 3):
    q, k, v, g, beta, _ = _inputs(sum(lengths), dk=16, dv=16, seed=seed)
    states = torch.randn(len(lengths), 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    outs, finals, lo = [], [], 0
    for run, n in enumerate(lengths):
        out, final = naive_gated_delta_rule(q[lo : lo + n], k[lo : lo + n], v[lo : lo + n], g[lo : lo + n],
                                            beta[lo : lo + n], states[run])
        outs.append(out)
        finals.append(final)
        lo += n
    return (q, k, v, g, beta, states), torch.cat(outs), torch.stack(finals)


VARLEN_LENGTHS = [[1, 16, 3, 16, 70], [130], [16] * 9 + [2]]


@pytest.mark.parametrize("lengths", VARLEN_LENGTHS)
def test_varlen_runs_match_each_run_alone(lengths: list[int]) -> None:
    inputs, out_ref, finals_ref = _varlen_case(lengths)
    out, finals = gated_delta_rule_varlen(*inputs[:5], lengths, inputs[5])
    assert _rel(out, out_ref) < 1e-5 and _rel(finals, finals_ref) < 1e-5


def test_varlen_bounds_are_built_once_per_shape() -> None:
    """Every layer of a pass hands FLA the same cu_seqlens tensors (FLA memoizes its chunk indices by
    their identity): the runs' bounds, on the host and the device, one pair per lengths."""
    host, device = run_bounds((5, 64, 1), torch.device("cpu"))
    assert host.tolist() == device.tolist() == [0, 5, 69, 70] and host.dtype == torch.long
    assert run_bounds((5, 64, 1), torch.device("cpu"))[1] is device
    assert run_bounds((5, 65), torch.device("cpu"))[1].tolist() == [0, 5, 70]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
@pytest.mark.parametrize("lengths", VARLEN_LENGTHS)
def test_fla_varlen_runs_match_each_run_alone_on_gpu(lengths: list[int]) -> None:
    inputs, out_ref, finals_ref = _varlen_case(lengths)
    out, finals = gated_delta_rule_varlen(*(x.cuda() for x in inputs[:5]), lengths, inputs[5].cuda())
    assert _rel(out.cpu(), out_ref) < 5e-3 and _rel(finals.cpu(), finals_ref) < 5e-3  # tf32 dots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
def test_fla_kernel_matches_reference_on_gpu() -> None:
    q, k, v, g, beta, state = _inputs(300, dv=16)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final = gated_delta_rule(*(x.cuda() for x in (q, k, v, g, beta, state)))
    assert _rel(out.cpu(), out_ref) < 5e-3 and _rel(final.cpu(), state_ref) < 5e-3  # tf32 dots


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
def test_gpu_dispatch_with_transition_matches_reference() -> None:
    q, k, v, g, beta, state = _inputs(150, dk=16, dv=16)
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final, transition = gated_delta_rule_with_transition(*(x.cuda() for x in (q, k, v, g, beta, state)))
    assert _rel(out.cpu(), out_ref) < 5e-3 and _rel(final.cpu(), state_ref) < 5e-3
    assert _rel(transition.cpu(), naive_transition(k, g, beta)) < 5e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
@pytest.mark.parametrize("case", ["zero-start", "carried-state", "transition", "short-carried"])
def test_gpu_dispatch_matches_reference_in_every_engine_use(case: str) -> None:
    """The engine's four uses of the rule: S_C|0, runs from a carried state, T_C (identity start,
    v = 0, q = k), and short runs (seams, decode) from a carried state."""
    steps = 8 if case == "short-carried" else 150
    q, k, v, g, beta, state = _inputs(steps, dk=16, dv=16)
    if case == "zero-start":
        state = None
    if case == "transition":
        q, v, state = k, torch.zeros_like(k), torch.eye(16).expand(3, 16, 16).contiguous()
    cuda = lambda x: None if x is None else x.cuda()  # noqa: E731
    out_ref, state_ref = naive_gated_delta_rule(q, k, v, g, beta, state)
    out, final = gated_delta_rule(*(cuda(x) for x in (q, k, v, g, beta, state)))
    assert _rel(final.cpu(), state_ref) < 5e-3
    if case != "transition":
        assert _rel(out.cpu(), out_ref) < 5e-3


def test_heads_first_carries_a_batch_dim() -> None:
    """A batch of 2 through the heads-first core equals each item alone through the naive loop."""
    items = [_inputs(90, seed=s) for s in (1, 2)]
    stacked = [torch.stack([item[i].transpose(0, 1) if i < 5 else item[i] for item in items])
               for i in range(6)]
    out, final = chunk_gated_delta_rule_heads_first(*stacked)
    for b, item in enumerate(items):
        out_ref, state_ref = naive_gated_delta_rule(*item)
        assert _rel(out[b].transpose(0, 1), out_ref) < 1e-5 and _rel(final[b], state_ref) < 1e-5


def _transformers_fallback():
    """transformers' own PyTorch chunked rule (FLA hidden so the module imports on CPU), given q and k
    already expanded to the value heads: transformers 5.17's rule wants equal head counts (its layer
    expands them first), later versions also take fewer key heads. The expansion is inside autograd,
    so the gradients of q and k are those of the unexpanded inputs."""
    import sys
    import inspect
    sys.modules.setdefault("fla", None)
    from transformers.models.qwen3_5 import modeling_qwen3_5
    # With FLA installed on a GPU machine transformers binds FLA's kernel; unwrap to its own code.
    rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)

    def expanded(query, key, value, *args, **kwargs):
        ratio = value.shape[2] // query.shape[2]
        return rule(query.repeat_interleave(ratio, 2), key.repeat_interleave(ratio, 2), value, *args, **kwargs)

    return expanded


def _layout_inputs(steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """transformers-layout inputs: q, k [2, T, 2, 16]; v [2, T, 4, 8]; g, beta [2, T, 4]; state."""
    gen = torch.Generator().manual_seed(steps)
    shapes = [(2, steps, 2, 16), (2, steps, 2, 16), (2, steps, 4, 8), (2, steps, 4), (2, steps, 4)]
    inputs = [torch.randn(s, generator=gen) for s in shapes]
    inputs[3] = -torch.rand(shapes[3], generator=gen) * 0.3
    inputs[4] = torch.rand(shapes[4], generator=gen)
    return inputs, torch.randn(2, 4, 16, 8, generator=gen)


def _run_with_grads(rule, inputs: list[torch.Tensor], state: torch.Tensor) -> list[torch.Tensor]:
    """[out, final state, grad of every input and of the state] for a squared-sum loss."""
    leaves = [x.clone().requires_grad_() for x in (*inputs, state)]
    out, final = rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    (out.float().square().sum() + final.float().square().sum()).backward()
    return [out.detach(), final.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("steps", [7, 64, 150])
def test_transformers_layout_matches_transformers_fallback(steps: int) -> None:
    """Outputs, final state and every input gradient equal transformers' implementation."""
    inputs, state = _layout_inputs(steps)
    theirs = _run_with_grads(_transformers_fallback(), inputs, state)
    ours = _run_with_grads(transformers_chunk_gated_delta_rule, inputs, state)
    for a, b in zip(ours, theirs):
        assert _rel(a, b) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA's Triton kernels need a GPU")
@pytest.mark.parametrize("steps", [7, 150])
def test_fla_training_rule_matches_ours_on_gpu(steps: int) -> None:
    """The rule training swaps in on CUDA (FLA, with autograd) equals ours on CPU."""
    from hypic.kernels.gated_delta.transformers_layout import fla_trains_here

    if not fla_trains_here():  # e.g. Hopper with Triton < 3.7.1: FLA refuses its backward
        pytest.skip("FLA's backward does not run on this GPU / Triton; training uses the PyTorch form")
    inputs, state = _layout_inputs(steps)
    ours = _run_with_grads(transformers_chunk_gated_delta_rule, inputs, state)
    fla = _run_with_grads(fla_transformers_chunk_gated_delta_rule, [x.cuda() for x in inputs], state.cuda())
    for a, b in zip(fla, ours):
        assert _rel(a.cpu(), b) < 5e-3
