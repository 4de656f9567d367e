"""Scalar-decay linear attention with RoPE applied to q and k inside the layer (Ring-linear style:
the "State RoPE re-rotation" of section 3.2 of the paper "HYPIC: Accelerating Hybrid-Attention LLM
Serving with Position-Independent Caching").

S_t = exp(-s_h) S_{t-1} + R(t) k_t v_t^T, o_t = D^-1/2 (R(t) q_t)^T S_t, with q, k, v = silu(W x) per head
(Lightning's projections, no conv), R(t) the rotary embedding of absolute position t on the first
rotary_dim key channels and s_h Lightning's per-head slopes. Because exp(-s_h) commutes with every
rotation, a segment's zero-start state cached at local start a serves start b as R(b - a) S_C|a
(eq. 7): ``rotate_state``. T_C is one scalar per head. A model type of ours (``hypic_hybrid`` with
``linear_family: scalar_rope``), written from the paper's description.
"""
import torch

from ..config import ModelConfig
from .lightning import OUTPUT_NORM_EPS, LightningAttention, LightningInputs, LightningProjections
from .norm import RMSNorm
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

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        self.norm = RMSNorm(self.heads * self.head_dim, OUTPUT_NORM_EPS)
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
        """S_C|(a + delta) from S_C|a (paper eq. 7)."""
        return self._rope(state.device).rotate_state(state, delta)
