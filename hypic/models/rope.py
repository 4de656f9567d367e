"""Rotary position embedding with partial rotary (also what moves cached keys: R(b - a) K_a = K_b)."""
import torch

from ..config import RopeConfig


class RotaryEmbedding:
    """Rotates the first ``rotary_dim`` channels of each head; the rest pass through."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device | str = "cpu") -> None:
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device="cpu") / self.rotary_dim
        self.inv_freq = (1.0 / rope.theta**exponents / rope.factor).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] (may be negative: a re-rotation delta) -> cos, sin [N, rotary_dim] fp32."""
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] rotated for positions [N] (``R(p) x``)."""
        cos, sin = self.cos_sin(positions)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot.float() * cos[:, None] + rotated_half.float() * sin[:, None]
        return torch.cat([out.to(x.dtype), rest], dim=-1)

    def rotate_state(self, state: torch.Tensor, delta: int) -> torch.Tensor:
        """R(delta) on the key axis of linear states [..., H, K, V] (paper eq. 7: S_C|b = R(b - a) S_C|a for
        a layer that rotates K inside a scalar-decay recurrence). The angles are formed in float64:
        a cached state may move by tens of thousands of positions, where fp32 angles are off by ~1e-3."""
        angles = float(delta) * self.inv_freq.double()
        cos, sin = angles.cos().repeat(2).float(), angles.sin().repeat(2).float()
        keys = state.transpose(-1, -2)  # [..., H, V, K]: every value column is a vector of the key space
        rot, rest = keys[..., : self.rotary_dim], keys[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos.to(rot.device) + rotated_half * sin.to(rot.device), rest], dim=-1).transpose(-1, -2)

