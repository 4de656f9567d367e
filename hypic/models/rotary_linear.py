"""Scalar-decay linear attention with RoPE applied to q and k inside the layer (Ring-linear style).

S_t = exp(-s_h) S_{t-1} + R(t) k_t v_t^T, o_t = D^-1/2 (R(t) q_t)^T S_t, with q, k, v = silu(W x) per head
(Lightning's projections, no conv), R(t) the rotary embedding of absolute position t on the first
rotary_dim key channels and s_h Lightning's per-head slopes. Because exp(-s_h) commutes with every
rotation, a segment's zero-start state cached at local start a serves start b as R(b - a) S_C|a:
``rotate_state``. T_C is one scalar per head. A model type of ours (``hypic_hybrid`` with
``linear_family: scalar_rope``).
"""
from typing import Any

import torch

from ..cache.composition import Family
from ..config import ModelConfig
from ..errors import UnsupportedModel
from ..kernels.scalar_gla import KERNELS
from .gated_deltanet import qwen_layout_sources
from .lightning import LightningAttention, LightningInputs, LightningProjections
from .linear import LinearFamily, qkvg
from .rope import RotaryEmbedding


class RotaryProjections(LightningProjections):
    """Lightning's projections and the tokens' absolute positions [N]."""

    def __init__(self, pre_conv: torch.Tensor, gate: torch.Tensor, g: torch.Tensor, positions: torch.Tensor) -> None:
        super().__init__(pre_conv, gate, g)
        self.positions = positions


class RotaryLinearAttention(LightningAttention):
    """Lightning's layer (recurrence, transitions, output) with q and k rotated at their positions and a
    zero-centred output norm; its cached states rotate with their start (``rotate_state``)."""

    rotates_state = True
    norm_unit_offset = True

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        self.rope_config = config.rope

    def _rope(self, device: torch.device) -> RotaryEmbedding:
        return RotaryEmbedding(self.rope_config, self.head_dim, device)

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> RotaryProjections:
        if positions is None:
            raise ValueError("a RoPE-in-state layer needs the tokens' positions")
        base = super().project(x)
        return RotaryProjections(base.pre_conv, base.gate, base.g, positions)

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: RotaryProjections) -> LightningInputs:  # type: ignore[override]
        plain = super().recurrence_inputs(post_conv, proj)
        rope = self._rope(post_conv.device)
        return LightningInputs(rope.apply(plain.q, proj.positions) * self.head_dim**-0.5,
                               rope.apply(plain.k, proj.positions), plain.v, plain.g)

    def rotate_state(self, state: torch.Tensor, delta: int) -> torch.Tensor:
        """S_C|(a + delta) from S_C|a: the cached state turned by R(delta)."""
        return self._rope(state.device).rotate_state(state, delta)


def check_native(text: dict[str, Any]) -> None:
    """A ``hypic_hybrid`` scalar_rope model: a key head per value head of the same width, no conv."""
    same_heads = text["linear_num_key_heads"] == text["linear_num_value_heads"]
    if not (same_heads and text["linear_key_head_dim"] == text["linear_value_head_dim"]
            and text.get("linear_conv_kernel_dim") == 1):
        raise UnsupportedModel("hypic_hybrid with scalar_rope needs equal key and value heads and widths and "
                               "linear_conv_kernel_dim 1")


FAMILY = LinearFamily("scalar_rope", RotaryLinearAttention, KERNELS, Family.SCALAR, qkvg, "linear_attn",
                      qwen_layout_sources, native=check_native)
