"""Gated DeltaNet token mixer: causal conv1d, then the gated delta rule over value heads."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.composition import Family, Transition
from ..config import ModelConfig
from ..parallel.sharding import Rule, Split
from ..kernels.gated_delta import KERNELS, gated_delta_rule, gated_delta_rule_with_transition, gated_delta_step
from ..loading.tensor_sources import Direct, PackedPart, Source
from .linear import (LinearFamily, RunRecurrence, any_native_fields, causal_conv, causal_conv_step,
                     qkvg_beta, recur_in_parts)
from .norm import GatedRMSNorm


@dataclass
class RecurrenceInputs:
    """What the recurrence consumes for N tokens (post-conv, normalised, expanded to value heads)."""

    q: torch.Tensor  # [N, Hv, K]
    k: torch.Tensor  # [N, Hv, K]
    v: torch.Tensor  # [N, Hv, V]
    g: torch.Tensor  # [N, Hv] log decay
    beta: torch.Tensor  # [N, Hv]

    def slice(self, lo: int, hi: int) -> "RecurrenceInputs":
        return RecurrenceInputs(self.q[lo:hi], self.k[lo:hi], self.v[lo:hi], self.g[lo:hi], self.beta[lo:hi])


@dataclass
class TokenProjections:
    """The token-wise inputs of a Gated DeltaNet layer for N tokens (no dependence between tokens)."""

    pre_conv: torch.Tensor  # [N, C] conv inputs, channels [q | k | v]
    z: torch.Tensor  # [N, Hv, V] output gate
    g: torch.Tensor  # [N, Hv] log decay, fp32
    beta: torch.Tensor  # [N, Hv] write strength, fp32


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: x / sqrt(sum x^2 + eps), in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Canonical layout: ``in_proj_qkv`` -> [q | k | v] channels (the conv's order), z, b, a.
    A ``linear.LinearMixer`` with dense transitions T = prod exp(g_t)(I - b_t k_t k_t^T)."""

    rotates_state = False

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        channels = config.linear_conv_channels
        self.in_proj_qkv = nn.Linear(config.hidden_size, channels, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_heads * self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(channels, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_heads * self.value_dim, config.hidden_size, bias=False)
        self.whole_heads = (config.whole.linear_num_key_heads, config.whole.linear_num_value_heads)

    def tp_rules(self) -> dict[str, Rule]:
        """Cut by heads: [q | k | v] channels and their conv by key and value heads, gates by value
        heads, the output projection's columns by value heads."""
        (key_heads, value_heads), dk, dv = self.whole_heads, self.key_dim, self.value_dim
        channels = Split(0, ((key_heads, dk), (key_heads, dk), (value_heads, dv)))
        per_head = Split(0, ((value_heads, 1),))
        return {"in_proj_qkv.weight": channels, "conv_weight": channels, "in_proj_z.weight": Split(0, ((value_heads, dv),)),
                "in_proj_b.weight": per_head, "in_proj_a.weight": per_head, "dt_bias": per_head, "A_log": per_head,
                "out_proj.weight": Split(1, ((value_heads, dv),))}

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> TokenProjections:
        """Token-wise projections of x [N, hidden]; the same for any grouping of tokens into runs."""
        n = x.shape[0]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        return TokenProjections(self.in_proj_qkv(x), self.in_proj_z(x).view(n, self.value_heads, self.value_dim), g,
                                torch.sigmoid(self.in_proj_b(x)).float())

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU over a conv window [k-1 + n, C] -> post-conv [n, C]."""
        return causal_conv(window, self.conv_weight)

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor:
        """One token of B requests: windows [B, k, C] (the last row the new token) -> [B, C]."""
        return causal_conv_step(window, self.conv_weight)

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: TokenProjections) -> RecurrenceInputs:
        """Split the conv output into q, k, v (normalised, expanded to the value heads)."""
        n, ratio = post_conv.shape[0], self.value_heads // self.key_heads
        q, k, v = post_conv.split([self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim], -1)
        q = l2_normalize(q.view(n, self.key_heads, self.key_dim)).repeat_interleave(ratio, 1)
        k = l2_normalize(k.view(n, self.key_heads, self.key_dim)).repeat_interleave(ratio, 1)
        return RecurrenceInputs(q, k, v.reshape(n, self.value_heads, self.value_dim).float(), proj.g, proj.beta)

    def recur(self, inputs: RecurrenceInputs, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence:
        """The gated delta rule over one run from ``state``; also the state after each offset in ``cuts``."""
        return recur_in_parts(lambda p, s: gated_delta_rule(p.q, p.k, p.v, p.g, p.beta, s), inputs, state, cuts)

    def recur_with_transition(self, inputs: RecurrenceInputs,
                              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Transition]:
        """``recur`` over one run, also returning the run's dense transition T [Hv, K, K]."""
        o, state, transition = gated_delta_rule_with_transition(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta,
                                                                state)
        return o, state, Transition(Family.DENSE, transition)

    def step(self, states: torch.Tensor, inputs: RecurrenceInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of B requests (inputs of B rows) from states [B, Hv, K, V]."""
        return gated_delta_step(states, inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)

    def output(self, o: torch.Tensor, proj: TokenProjections, dtype: torch.dtype) -> torch.Tensor:
        """Gated norm and output projection: o [N, Hv, V] -> [N, hidden]."""
        return self.out_proj(self.norm(o.to(dtype), proj.z).reshape(o.shape[0], -1))


def qwen_layout_sources(config: ModelConfig, prefix: str, keys: dict[str, str]) -> dict[str, Source]:
    """A linear layer in Qwen's names (``keys``: short name in the layer's linear_attn -> checkpoint
    key): ours, or Qwen3-Next's packed in_proj_qkvz / in_proj_ba (per key-head group) and its conv1d."""
    out: dict[str, Source] = {name: Direct(key) for name, key in keys.items()
                              if not name.startswith(("in_proj_qkvz", "in_proj_ba", "conv1d"))}
    if "in_proj_qkvz.weight" in keys and "in_proj_ba.weight" in keys:
        out.update(_packed_sources(config, keys["in_proj_qkvz.weight"], keys["in_proj_ba.weight"]))
    if "conv1d.weight" in keys:
        out["conv_weight"] = Direct(keys["conv1d.weight"])
    return {f"{prefix}mixer.{name}": source for name, source in out.items()}


def _packed_sources(config: ModelConfig, qkvz: str, ba: str) -> dict[str, Source]:
    """Qwen3-Next's projections packed per key-head group: [q | k | v | z] and [b | a]."""
    ratio, dk, dv = config.linear_value_ratio, config.linear_key_head_dim, config.linear_value_head_dim
    groups = config.linear_num_key_heads
    out: dict[str, Source] = {f"in_proj_{part}.weight": PackedPart(qkvz, part, groups, (dk, dk, ratio * dv, ratio * dv))
                              for part in ("qkv", "z")}
    out.update({f"in_proj_{part}.weight": PackedPart(ba, part, groups, (ratio, ratio)) for part in ("b", "a")})
    return out


FAMILY = LinearFamily("gated_delta", GatedDeltaNet, KERNELS, Family.DENSE, qkvg_beta, "linear_attn",
                      qwen_layout_sources, native=any_native_fields)
