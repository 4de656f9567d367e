"""Paper eq. 7 for a scalar-decay linear layer that rotates q and k inside its recurrence (Ring-linear
style): S_C|b = R(b - a) S_C|a, so a segment cached at start 0 composes behind any prefix as
S' = T_C S + R(p) S_C|0. The oracle computes every rotation at its absolute position in float64."""
import pytest
import torch

from hypic.config import RopeConfig
from hypic.kernels.scalar_gla import naive_scalar_gla
from hypic.models.rope import RotaryEmbedding

HEADS, DIM, VALUE = 2, 16, 8


def _rope(partial: float) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(theta=10000.0, partial_rotary_factor=partial), DIM)


def _rotated(rope: RotaryEmbedding, x: torch.Tensor, start: int) -> torch.Tensor:
    """x [n, H, K] rotated at positions start, start + 1, ... with float64 angles (the oracle's)."""
    angles = torch.arange(start, start + x.shape[0], dtype=torch.float64)[:, None] * rope.inv_freq.double()[None]
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    x = x.double()
    rot, rest = x[..., : rope.rotary_dim], x[..., rope.rotary_dim :]
    half = rope.rotary_dim // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + turned * sin, rest], dim=-1)


def _segment(n: int, seed: int, constant_decay: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, HEADS, DIM, generator=gen), torch.randn(n, HEADS, DIM, generator=gen)
    v = torch.randn(n, HEADS, VALUE, generator=gen)
    g = torch.full((n, HEADS), -0.02) if constant_decay else -0.05 * torch.rand(n, HEADS, generator=gen)
    return q, k, v, g


def _state_at(rope: RotaryEmbedding, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, start: int,
              initial: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's state after the tokens at positions start.. (float64 throughout: the oracle)."""
    state = torch.zeros(HEADS, DIM, VALUE, dtype=torch.float64) if initial is None else initial.double()
    for key, value, decay in zip(_rotated(rope, k, start), v.double(), g.double()):
        state = decay.exp()[:, None, None] * state + key[:, :, None] * value[:, None, :]
    return state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("constant_decay", [True, False])
@pytest.mark.parametrize("a, b", [(0, 1), (0, 1000), (17, 4096), (0, 32767), (32000, 5), (123, 31111)])
def test_rotate_then_compose_equals_compute_at_position(partial: float, constant_decay: bool, a: int, b: int) -> None:
    """S_C|b = R(b - a) S_C|a to fp32 round-off for starts up to 32k (the cached state in fp32,
    as the public pool keeps it)."""
    rope = _rope(partial)
    _, k, v, g = _segment(60, a + b, constant_decay)
    cached = _state_at(rope, k, v, g, a).float()
    assert _rel(rope.rotate_state(cached, b - a), _state_at(rope, k, v, g, b)) < 1e-5


def test_composition_behind_a_prefix_uses_the_rotated_zero_start_state() -> None:
    """S' = T_C S + R(p) S_C|0 equals running the prefix and then the segment at position p; without the
    rotation the composed state is far off (the reason a RoPE-in-state layer needs eq. 7)."""
    rope = _rope(1.0)
    _, k_prefix, v_prefix, g_prefix = _segment(40, 1, False)
    _, k, v, g = _segment(70, 2, False)
    prefix = _state_at(rope, k_prefix, v_prefix, g_prefix, 0)
    expected = _state_at(rope, k, v, g, 40, initial=prefix)
    zero_start = _state_at(rope, k, v, g, 0).float()
    transition = g.double().sum(0).exp()[:, None, None]  # T_C = prod of the gates, one scalar per head
    composed = transition * prefix + rope.rotate_state(zero_start, 40).double()
    assert _rel(composed, expected) < 1e-5
    assert _rel(transition * prefix + zero_start.double(), expected) > 0.1


def test_the_layer_is_the_scalar_gated_kernel_on_rotated_inputs() -> None:
    """The recurrence the oracle runs is the runtime's scalar-gated kernel fed rotated q and k."""
    rope = _rope(1.0)
    q, k, v, g = _segment(50, 3, False)
    positions = torch.arange(200, 250)
    out, state = naive_scalar_gla(rope.apply(q, positions), rope.apply(k, positions), v, g)
    assert _rel(state, _state_at(rope, k, v, g, 200)) < 1e-5
    expected = torch.einsum("nhk,nhkv->nhv", _rotated(rope, q, 200)[:1], _state_at(rope, k[:1], v[:1], g[:1], 200)[None])
    assert _rel(out[:1], expected) < 1e-5
