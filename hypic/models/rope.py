"""Rotary position embedding with partial rotary (also what moves cached keys: R(b - a) K_a = K_b)."""
import math

import torch

from ..config import RopeConfig, YarnScaling


def yarn_inv_freq(rope: RopeConfig, yarn: YarnScaling, dim: int) -> torch.Tensor:
    """YaRN's frequencies [dim / 2]: each channel pair blends the original frequency (fast channels)
    and the one divided by the rope factor (slow channels) along a linear ramp between the channels
    that turn ``beta_fast`` and ``beta_slow`` times over the original context."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    pos_freqs = rope.theta**exponents

    def channel(turns: float) -> float:
        return dim * math.log(yarn.original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = channel(yarn.beta_fast), channel(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return (1.0 / (rope.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp)


def attention_factor(rope: RopeConfig) -> float:
    """How much YaRN scales the rotated channels (1 without YaRN)."""
    if rope.yarn is None:
        return 1.0
    if rope.yarn.attention_factor is not None:
        return float(rope.yarn.attention_factor)
    return 0.1 * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0


class RotaryEmbedding:
    """Rotates ``rotary_dim`` channels of each head, the first ones (or the last: ``rope.rotated_last``);
    the rest pass through."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor) if rope.rotary_dim is None else rope.rotary_dim
        self.first = head_dim - self.rotary_dim if rope.rotated_last else 0  # the first rotated channel
        if rope.yarn is not None:
            self.inv_freq = yarn_inv_freq(rope, rope.yarn, self.rotary_dim).to(device)
        else:
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device="cpu") / self.rotary_dim
            self.inv_freq = (1.0 / rope.theta**exponents / rope.factor).to(device)
        self.scale = attention_factor(rope)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] (may be negative: a re-rotation delta) -> cos, sin [N, rotary_dim] fp32. The
        last call's are kept for the same tensor: every layer of a pass rotates by the same positions."""
        last = self._last
        if last is not None and last[0] is positions:
            return last[1], last[2]
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        self._last = (positions, emb.cos(), emb.sin())
        return self._last[1], self._last[2]

    def apply(self, x: torch.Tensor, positions: torch.Tensor, scaled: bool = True) -> torch.Tensor:
        """x [N, H, D] rotated for positions [N] (``R(p) x``), the rotated channels times YaRN's
        attention factor when ``scaled`` (projections; a re-rotation by a delta is not scaled again)."""
        cos, sin = self.cos_sin(positions)
        if scaled and self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        lo, hi = self.first, self.first + self.rotary_dim
        rot, half = x[..., lo:hi], self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot.float() * cos[:, None] + rotated_half.float() * sin[:, None]
        return torch.cat([x[..., :lo], out.to(x.dtype), x[..., hi:]], dim=-1)

    def rotate_state(self, state: torch.Tensor, delta: int) -> torch.Tensor:
        """R(delta) on the key axis of linear states [..., H, K, V] (paper eq. 7: S_C|b = R(b - a) S_C|a for
        a layer that rotates K inside a scalar-decay recurrence)."""
        return self.rotate_states(state[None], [delta])[0]

    def rotate_states(self, states: torch.Tensor, deltas: list[int]) -> torch.Tensor:
        """``rotate_state`` of each of states [S, ..., H, K, V] by its own delta. The angles are formed in
        float64: a cached state may move by tens of thousands of positions, where fp32 angles are off by ~1e-3."""
        angles = torch.tensor(deltas, dtype=torch.float64, device="cpu")[:, None] * self.inv_freq.double().cpu()
        shape = (len(deltas), *([1] * (states.dim() - 2)), self.rotary_dim)
        cos, sin = (x.repeat(1, 2).float().reshape(shape).to(states.device) for x in (angles.cos(), angles.sin()))
        keys = states.transpose(-1, -2)  # [..., H, V, K]: every value column is a vector of the key space
        rot, rest = keys[..., : self.rotary_dim], keys[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated_half * sin, rest], dim=-1).transpose(-1, -2)
