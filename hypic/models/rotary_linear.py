"""Scalar-decay linear attention with RoPE applied to q and k inside the layer (Ring-linear style).

S_t = exp(-s_h) S_{t-1} + R(t) k_t v_t^T, o_t = D^-1/2 (R(t) q_t)^T S_t, with q, k, v = silu(W x) per head
(Lightning's projections, no conv), R(t) the rotary embedding of absolute position t on the first
rotary_dim key channels and s_h Lightning's per-head slopes. Because exp(-s_h) commutes with every
rotation, a segment's zero-start state cached at local start a serves start b as R(b - a) S_C|a:
``rotate_state``. T_C is one scalar per head. A model type of ours (``hypic_hybrid`` with
``linear_family: scalar_rope``), and Ring-linear's Lightning layers (``bailing_moe_linear``:
``RingLinearAttention``, the same recurrence and cache with Ring's projections, norms and slopes).
"""
import math

from typing import Any

import torch

from ..cache.composition import Family
from ..config import ModelConfig
from ..errors import UnsupportedModel
from ..kernels.scalar_gla import KERNELS
from ..parallel.sharding import Rule, Split, units_of_rank
from .gated_deltanet import qwen_layout_sources
from .lightning import LightningAttention, LightningInputs, LightningProjections
from .linear import LinearFamily, LinearMixer, qkvg
from .norm import GroupRMSNorm, RMSNorm, ShardedRMSNorm
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

    def rotate_states(self, states: torch.Tensor, deltas: list[int]) -> torch.Tensor:
        """``rotate_state`` of each of states [S, H, K, V] by its own delta, in one go."""
        return self._rope(states.device).rotate_states(states, deltas)


def alibi_slopes(heads: int) -> list[float]:
    """ALiBi's slopes: (2^(-8/n))^(h+1) for n heads a power of two; otherwise the slopes of the power
    of two below, then every other slope of twice that power."""
    if math.log2(heads).is_integer():
        return [2 ** (-8 / heads * (h + 1)) for h in range(heads)]
    below = 2 ** math.floor(math.log2(heads))
    return alibi_slopes(below) + alibi_slopes(2 * below)[0::2][: heads - below]


def ring_slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """Ring-linear's decay rates [H] of layer ``layer`` (its index from 0 among all layers) of ``layers``:
    ALiBi's slopes times 1 - layer / (layers - 1) + 1e-5, as the vendor's training code and SGLang's
    and vLLM's Bailing backends compute them (the transformers file shipped with the checkpoints is
    one layer off: docs/models.md)."""
    depth = 1 - layer / (layers - 1) + 1e-5 if layers > 1 else 1 + 1e-5
    return torch.tensor(alibi_slopes(heads), dtype=torch.float32, device="cpu") * depth


class RingLinearAttention(RotaryLinearAttention):
    """Ring-linear's Lightning layer: S_t = exp(-s_h) S_{t-1} + R(t) k_t v_t^T, o_t = D^-1/2 (R(t) q_t)^T S_t
    with [Q | K | V] = W x (no activation), q and k RMS-normed per head before RoPE (partial, rotate-half),
    o RMS-normed per group of heads, then sigmoid(W_g x) * o and the dense projection."""

    norm_unit_offset = False

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        assert config.ring_linear is not None
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=False)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=False)
        self.norm = self._output_norm(config, config.ring_linear.norm_groups)
        slopes = ring_slopes(self.whole_heads, index, config.num_hidden_layers)
        first, count = units_of_rank(len(slopes), config.tensor_parallel)
        self.slopes = tuple(slopes[first:first + count].tolist())

    def _output_norm(self, config: ModelConfig, groups: int) -> RMSNorm:
        """One group: the norm over all heads (sharded under tensor parallelism); more: each rank
        normalises its own whole groups."""
        width, tp = self.heads * self.head_dim, config.tensor_parallel
        if groups == 1:
            return ShardedRMSNorm(width, self.whole_heads * self.head_dim, config.rms_norm_eps, tp, False)
        if groups % tp.size:
            raise UnsupportedModel(f"group_norm_size {groups} cannot be split over {tp.size} tensor-parallel ranks")
        return GroupRMSNorm(width, groups // tp.size, config.rms_norm_eps)

    def tp_rules(self) -> dict[str, Rule]:
        """As Lightning's, but q, k and v are three blocks of heads (q and k norms: replicated)."""
        return {**super().tp_rules(), "qkv_proj.weight": Split(0, ((self.whole_heads, self.head_dim),) * 3)}

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        """No conv and no activation: each token's own projection."""
        return window

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor:
        return window[:, -1]

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: RotaryProjections) -> LightningInputs:  # type: ignore[override]
        q, k, v = post_conv.float().view(post_conv.shape[0], 3, self.heads, self.head_dim).unbind(1)
        rope = self._rope(post_conv.device)
        q, k = rope.apply(self.q_norm(q), proj.positions), rope.apply(self.k_norm(k), proj.positions)
        return LightningInputs(q * self.head_dim**-0.5, k, v, proj.g)


def scalar_rope_mixer(config: ModelConfig, index: int) -> LinearMixer:
    """Layer ``index``'s mixer: Ring-linear's form where the config says so, else ours."""
    if config.ring_linear is not None:
        return RingLinearAttention(config, index)
    return RotaryLinearAttention(config, index)


def check_native(text: dict[str, Any]) -> None:
    """A ``hypic_hybrid`` scalar_rope model: a key head per value head of the same width, no conv."""
    same_heads = text["linear_num_key_heads"] == text["linear_num_value_heads"]
    if not (same_heads and text["linear_key_head_dim"] == text["linear_value_head_dim"]
            and text.get("linear_conv_kernel_dim") == 1):
        raise UnsupportedModel("hypic_hybrid with scalar_rope needs equal key and value heads and widths and "
                               "linear_conv_kernel_dim 1")


FAMILY = LinearFamily("scalar_rope", scalar_rope_mixer, KERNELS, Family.SCALAR, qkvg, "linear_attn",
                      qwen_layout_sources, native=check_native)
