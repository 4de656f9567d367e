"""Lightning attention (MiniMax-Text-01): linear attention with a constant decay per head.

S_t = exp(-s_h) S_{t-1} + k_t v_t^T, o_t = q_t^T S_t, with q, k, v = silu(W x) and no short conv,
no normalisation of q or k and no scale. The slope s_h depends on the head and the layer's depth
(ALiBi-like). T_C is one scalar per head, exp(-s_h |C|): composing a cached segment costs a scale
and an add per state element, no matmul.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.composition import Family, Transition, scalar_transition
from ..config import ModelConfig
from ..kernels.scalar_gla import KERNELS, scalar_gla, scalar_gla_step
from ..parallel.sharding import Rule, Split, units_of_rank
from .linear import LinearFamily, RunRecurrence, direct_sources, qkvg, recur_in_parts
from .norm import ShardedRMSNorm

OUTPUT_NORM_EPS = 1e-6  # MiniMax's output norm keeps the RMSNorm default, not the config's eps


def lightning_slopes(heads: int, layer: int, layers: int) -> torch.Tensor:
    """Decay rate s_h per head [H] of layer ``layer`` of ``layers`` (MiniMax's formula): the
    geometric ALiBi slopes, scaled down with depth (the last layer barely decays)."""
    base = 1 / (2 ** (8 / heads))
    depth = 1 - layer / (layers - 1 + 1e-5) + 1e-5
    return base ** (torch.arange(heads, device="cpu") + 1) * depth  # on the CPU even while a model is built on meta


def rank_slopes(config: ModelConfig, layer: int) -> tuple[float, ...]:
    """The decay rates of this rank's heads: its slice of the whole layer's (a slope depends on the
    head's index among all the layer's heads)."""
    slopes = lightning_slopes(config.whole.linear_num_value_heads, layer, config.num_hidden_layers)
    first, count = units_of_rank(len(slopes), config.tensor_parallel)
    return tuple(slopes[first:first + count].tolist())


@dataclass
class LightningProjections:
    """Token-wise inputs of N tokens: the qkv projection (heads interleaved, [q_h | k_h | v_h]
    per head), the output gate before its sigmoid, and the log decay."""

    pre_conv: torch.Tensor  # [N, 3 H D]
    gate: torch.Tensor  # [N, H D]
    g: torch.Tensor  # [N, H] fp32, -s_h for every token


@dataclass
class LightningInputs:
    q: torch.Tensor  # [N, H, D]
    k: torch.Tensor  # [N, H, D]
    v: torch.Tensor  # [N, H, D]
    g: torch.Tensor  # [N, H]

    def slice(self, lo: int, hi: int) -> "LightningInputs":
        return LightningInputs(self.q[lo:hi], self.k[lo:hi], self.v[lo:hi], self.g[lo:hi])


class LightningAttention(nn.Module):
    """A ``linear.LinearMixer`` with scalar transitions; ``kernel`` 1: the conv window is the token."""

    rotates_state = False
    kernel = 1
    norm_unit_offset = False  # MiniMax's output norm: the plain w * x / rms(x)

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.heads, self.head_dim = config.linear_num_value_heads, config.linear_value_head_dim
        width = self.heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * width, bias=False)
        self.output_gate = nn.Linear(config.hidden_size, width, bias=False)
        self.whole_heads = config.whole.linear_num_value_heads
        self.norm = ShardedRMSNorm(width, self.whole_heads * self.head_dim, OUTPUT_NORM_EPS, config.tensor_parallel,
                                   self.norm_unit_offset)
        self.out_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.slopes = rank_slopes(config, index)

    def tp_rules(self) -> dict[str, Rule]:
        """Cut by heads: each head's interleaved [q_h | k_h | v_h] rows, its gate rows and output norm
        weights (the norm's mean square is all-reduced), the output projection's columns."""
        heads, dim = self.whole_heads, self.head_dim
        per_head = Split(0, ((heads, dim),))
        return {"qkv_proj.weight": Split(0, ((heads, 3 * dim),)), "output_gate.weight": per_head,
                "norm.weight": per_head, "out_proj.weight": Split(1, ((heads, dim),))}

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> LightningProjections:
        g = -torch.tensor(self.slopes, device=x.device, dtype=torch.float32).expand(x.shape[0], -1)
        return LightningProjections(self.qkv_proj(x), self.output_gate(x), g)

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        """No conv: the activation of each token's own projection ([n, C] -> [n, C])."""
        return F.silu(window)

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor:
        return F.silu(window[:, -1])

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: LightningProjections) -> LightningInputs:
        q, k, v = post_conv.float().view(post_conv.shape[0], self.heads, 3 * self.head_dim).split(self.head_dim, -1)
        return LightningInputs(q, k, v, proj.g)

    def recur(self, inputs: LightningInputs, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence:
        return recur_in_parts(lambda p, s: scalar_gla(p.q, p.k, p.v, p.g, s), inputs, state, cuts)

    def recur_with_transition(self, inputs: LightningInputs,
                              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Transition]:
        """One run, and its transition exp(sum_t g_t) per head (closed form, [H])."""
        o, state = scalar_gla(inputs.q, inputs.k, inputs.v, inputs.g, state)
        return o, state, scalar_transition(inputs.g)

    def step(self, states: torch.Tensor, inputs: LightningInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return scalar_gla_step(states, inputs.q, inputs.k, inputs.v, inputs.g)

    def output(self, o: torch.Tensor, proj: LightningProjections, dtype: torch.dtype) -> torch.Tensor:
        """Norm over all heads together, sigmoid gate, projection: o [N, H, D] -> [N, hidden]."""
        normed = self.norm(o.to(dtype).reshape(o.shape[0], -1))
        return self.out_proj(torch.sigmoid(proj.gate) * normed)


FAMILY = LinearFamily("lightning", LightningAttention, KERNELS, Family.SCALAR, qkvg, "self_attn", direct_sources)
