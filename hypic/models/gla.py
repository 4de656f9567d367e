"""Gated linear attention with a gate per key channel (GLA): the diagonal family.

S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = K^-1/2 q_t^T S_t, with q, k, v out of a short causal
conv + SiLU (as in Gated DeltaNet), g_t = logsigmoid(W_g x_t) / 16 per key channel (GLA's
normaliser keeps the forgetting slow), and Gated DeltaNet's gated output norm. T_C is a vector per
head, exp(sum_t g_t): composing costs a per-row scale and an add. A model type of ours
(``hypic_hybrid`` with ``linear_family: gla``); no published checkpoint uses exactly this layer.
"""
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.composition import Family, Transition, diagonal_transition
from ..config import ModelConfig
from ..errors import UnsupportedModel
from ..kernels.diagonal_gla import KERNELS, diagonal_gla, diagonal_gla_step
from ..parallel.sharding import Rule, Split
from .gated_deltanet import qwen_layout_sources
from .linear import LinearFamily, RunRecurrence, causal_conv, causal_conv_step, qkvg, recur_in_parts
from .norm import GatedRMSNorm

GATE_NORMALIZER = 16.0


@dataclass
class GLAProjections:
    pre_conv: torch.Tensor  # [N, C] conv inputs [q | k | v]
    z: torch.Tensor  # [N, H, V] output gate
    g: torch.Tensor  # [N, H, K] fp32 log decay per key channel


@dataclass
class GLAInputs:
    q: torch.Tensor  # [N, H, K]
    k: torch.Tensor  # [N, H, K]
    v: torch.Tensor  # [N, H, V]
    g: torch.Tensor  # [N, H, K]

    def slice(self, lo: int, hi: int) -> "GLAInputs":
        return GLAInputs(self.q[lo:hi], self.k[lo:hi], self.v[lo:hi], self.g[lo:hi])


class GatedLinearAttention(nn.Module):
    """A ``linear.LinearMixer`` with diagonal transitions (one head of keys per head of values)."""

    rotates_state = False

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.heads, self.key_dim, self.value_dim = (config.linear_num_value_heads, config.linear_key_head_dim,
                                                    config.linear_value_head_dim)
        self.kernel, channels = config.linear_conv_kernel_dim, config.linear_conv_channels
        self.in_proj_qkv = nn.Linear(config.hidden_size, channels, bias=False)
        self.in_proj_g = nn.Linear(config.hidden_size, self.heads * self.key_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.heads * self.value_dim, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(channels, self.kernel))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.heads * self.value_dim, config.hidden_size, bias=False)
        self.whole_heads = config.whole.linear_num_value_heads

    def tp_rules(self) -> dict[str, Rule]:
        """Cut by heads: [q | k | v] channels and their conv, the decay gates by key heads, the output
        gate by value heads, the output projection's columns by value heads (the norm is per head)."""
        heads, dk, dv = self.whole_heads, self.key_dim, self.value_dim
        channels = Split(0, ((heads, dk), (heads, dk), (heads, dv)))
        return {"in_proj_qkv.weight": channels, "conv_weight": channels, "in_proj_g.weight": Split(0, ((heads, dk),)),
                "in_proj_z.weight": Split(0, ((heads, dv),)), "out_proj.weight": Split(1, ((heads, dv),))}

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> GLAProjections:
        n = x.shape[0]
        g = F.logsigmoid(self.in_proj_g(x).float()).view(n, self.heads, self.key_dim) / GATE_NORMALIZER
        return GLAProjections(self.in_proj_qkv(x), self.in_proj_z(x).view(n, self.heads, self.value_dim), g)

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        return causal_conv(window, self.conv_weight)

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor:
        return causal_conv_step(window, self.conv_weight)

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: GLAProjections) -> GLAInputs:
        n, keys = post_conv.shape[0], self.heads * self.key_dim
        q, k, v = post_conv.float().split([keys, keys, self.heads * self.value_dim], dim=-1)
        view = lambda t, d: t.reshape(n, self.heads, d)  # noqa: E731
        return GLAInputs(view(q, self.key_dim) * self.key_dim**-0.5, view(k, self.key_dim), view(v, self.value_dim),
                         proj.g)

    def recur(self, inputs: GLAInputs, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence:
        return recur_in_parts(lambda p, s: diagonal_gla(p.q, p.k, p.v, p.g, s), inputs, state, cuts)

    def recur_with_transition(self, inputs: GLAInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Transition]:
        """One run, and its transition exp(sum_t g_t) per head and key channel ([H, K])."""
        o, state = diagonal_gla(inputs.q, inputs.k, inputs.v, inputs.g, state)
        return o, state, diagonal_transition(inputs.g)

    def step(self, states: torch.Tensor, inputs: GLAInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return diagonal_gla_step(states, inputs.q, inputs.k, inputs.v, inputs.g)

    def output(self, o: torch.Tensor, proj: GLAProjections, dtype: torch.dtype) -> torch.Tensor:
        return self.out_proj(self.norm(o.to(dtype), proj.z).reshape(o.shape[0], -1))


def check_native(text: dict[str, Any]) -> None:
    """A ``hypic_hybrid`` GLA model has one key head per value head."""
    if text["linear_num_key_heads"] != text["linear_num_value_heads"]:
        raise UnsupportedModel("hypic_hybrid with gla needs linear_num_key_heads == linear_num_value_heads")


FAMILY = LinearFamily("gla", GatedLinearAttention, KERNELS, Family.DIAGONAL, qkvg, "linear_attn", qwen_layout_sources,
                      native=check_native)
