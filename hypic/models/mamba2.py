"""Mamba2 (the SSM layers of Granite-4.0-H): a scalar-decay linear recurrence in attention form.

Per head h with step dt_t = clamp(softplus(W_dt x_t + b_h)): S_t = exp(dt_t A_h) S_{t-1} + B_t (dt_t x_t)^T
and y_t = C_t^T S_t + D_h x_t, where x, B, C come out of a causal conv (with bias) + SiLU and B, C are
shared by the heads of a group (like the keys of grouped-query attention). So q = C, k = B,
v = dt x, and T_C is one scalar per head, exp(A_h sum_t dt_t). The state is d_state x head_dim.
The output is normalised per group after the gate: norm(y * silu(z)) * w, then projected.
Under tensor parallelism a rank holds 1/N of the heads; groups fewer than the ranks are replicated,
and the norm of a group spread over several ranks sums its squares over them.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.composition import Family, Transition, scalar_transition
from ..config import Mamba2Options, ModelConfig
from ..kernels.scalar_gla import KERNELS, scalar_gla, scalar_gla_step
from ..parallel import all_reduce
from ..parallel.sharding import FirstRank, Rule, Split, units_of_rank
from ..loading.tensor_sources import Direct, Source
from .linear import LinearFamily, RunRecurrence, causal_conv, causal_conv_step, qkvg, recur_in_parts


@dataclass
class Mamba2Projections:
    """Token-wise inputs of N tokens: conv inputs [x | B | C], the output gate z, the step dt and
    the log decay g = dt A."""

    pre_conv: torch.Tensor  # [N, C]
    gate: torch.Tensor  # [N, H P]
    dt: torch.Tensor  # [N, H] fp32
    g: torch.Tensor  # [N, H] fp32


@dataclass
class Mamba2Inputs:
    q: torch.Tensor  # [N, H, S] C, expanded to the heads
    k: torch.Tensor  # [N, H, S] B, expanded to the heads
    v: torch.Tensor  # [N, H, P] dt x
    g: torch.Tensor  # [N, H]
    skip: torch.Tensor  # [N, H, P] D x, added to the outputs

    def slice(self, lo: int, hi: int) -> "Mamba2Inputs":
        return Mamba2Inputs(self.q[lo:hi], self.k[lo:hi], self.v[lo:hi], self.g[lo:hi], self.skip[lo:hi])


class Mamba2Mixer(nn.Module):
    """A ``linear.LinearMixer`` with scalar transitions and a short conv of ``kernel`` taps."""

    rotates_state = False

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        options = config.mamba or Mamba2Options()
        self.heads, self.head_dim = config.linear_num_value_heads, config.linear_value_head_dim
        self.groups, self.state_dim = config.linear_num_key_heads, config.linear_key_head_dim
        self.kernel, self.time_step_limit = config.linear_conv_kernel_dim, options.time_step_limit
        inner, channels = self.heads * self.head_dim, config.linear_conv_channels
        self.in_proj = nn.Linear(config.hidden_size, inner + channels + self.heads, bias=options.proj_bias)
        self.conv_weight = nn.Parameter(torch.zeros(channels, self.kernel))
        self.conv_bias = nn.Parameter(torch.zeros(channels)) if options.conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.eps = config.rms_norm_eps
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=options.proj_bias)
        self.tp, self.whole_heads = config.tensor_parallel, (config.whole.linear_num_key_heads,
                                                             config.whole.linear_num_value_heads)

    def tp_rules(self) -> dict[str, Rule]:
        """Cut by heads: in_proj's [z | x | B | C | dt] rows and the conv's [x | B | C] channels (B and C
        by group, replicated when the groups are fewer than the ranks), the per-head constants, the norm
        weight, and the output projection's columns; its bias added once."""
        (groups, heads), state, width = self.whole_heads, self.state_dim, self.head_dim
        conv = ((heads, width), (groups, state), (groups, state))
        rows, per_head = Split(0, ((heads, width), *conv, (heads, 1))), Split(0, ((heads, 1),))
        return {"in_proj.weight": rows, "in_proj.bias": rows, "conv_weight": Split(0, conv),
                "conv_bias": Split(0, conv), "dt_bias": per_head, "A_log": per_head, "D": per_head,
                "norm_weight": Split(0, ((heads, width),)), "out_proj.weight": Split(1, ((heads, width),)),
                "out_proj.bias": FirstRank()}

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Mamba2Projections:
        inner = self.heads * self.head_dim
        gate, pre_conv, dt = self.in_proj(x).split([inner, self.conv_weight.shape[0], self.heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.time_step_limit)
        return Mamba2Projections(pre_conv, gate, dt, -self.A_log.float().exp() * dt)

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        return causal_conv(window, self.conv_weight, self.conv_bias)

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor:
        return causal_conv_step(window, self.conv_weight, self.conv_bias)

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: Mamba2Projections) -> Mamba2Inputs:
        n, ratio, grouped = post_conv.shape[0], self.heads // self.groups, self.groups * self.state_dim
        x, b, c = post_conv.float().split([self.heads * self.head_dim, grouped, grouped], dim=-1)
        x = x.view(n, self.heads, self.head_dim)
        expand = lambda t: t.view(n, self.groups, self.state_dim).repeat_interleave(ratio, 1)  # noqa: E731
        return Mamba2Inputs(expand(c), expand(b), x * proj.dt[..., None], proj.g, self.D.float()[:, None] * x)

    def _rule(self, inputs: Mamba2Inputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o, state = scalar_gla(inputs.q, inputs.k, inputs.v, inputs.g, state)
        return o + inputs.skip, state

    def recur(self, inputs: Mamba2Inputs, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence:
        return recur_in_parts(self._rule, inputs, state, cuts)

    def recur_with_transition(self, inputs: Mamba2Inputs,
                              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Transition]:
        """One run, and its transition exp(A_h sum_t dt_t) per head (closed form, [H])."""
        o, state = self._rule(inputs, state)
        return o, state, scalar_transition(inputs.g)

    def step(self, states: torch.Tensor, inputs: Mamba2Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        o, states = scalar_gla_step(states, inputs.q, inputs.k, inputs.v, inputs.g)
        return o + inputs.skip, states

    def output(self, o: torch.Tensor, proj: Mamba2Projections, dtype: torch.dtype) -> torch.Tensor:
        """Gate, grouped RMSNorm, projection: o [N, H, P] -> [N, hidden]."""
        n = o.shape[0]
        y = (o.reshape(n, -1) * F.silu(proj.gate.float())).view(n, self.groups, -1)
        y = (y * torch.rsqrt(self._mean_square(y) + self.eps)).view(n, -1)
        return self.out_proj(self.norm_weight * y.to(dtype))

    def _mean_square(self, y: torch.Tensor) -> torch.Tensor:
        """Each group's mean square of y [N, G, width] -> [N, G, 1]; a group held by several ranks
        (groups fewer than the ranks: G = 1 here) sums its squares over them."""
        groups = self.whole_heads[0]
        if not self.tp.enabled or groups % self.tp.size == 0:
            return y.pow(2).mean(-1, keepdim=True)
        group, _ = units_of_rank(groups, self.tp)
        sums = y.new_zeros(y.shape[0], groups)
        sums[:, group] = y.pow(2).sum((1, 2))
        width = self.whole_heads[1] // groups * self.head_dim
        return (all_reduce(sums, self.tp)[:, group] / width)[:, None, None]


RENAMED = {"conv1d.weight": "conv_weight", "conv1d.bias": "conv_bias", "norm.weight": "norm_weight"}


def mamba_sources(config: ModelConfig, prefix: str, keys: dict[str, str]) -> dict[str, Source]:
    """A Mamba2 layer (``keys``: its mamba tensors), its conv and norm renamed to ours."""
    return {f"{prefix}mixer.{RENAMED.get(name, name)}": Direct(key) for name, key in keys.items()}


def skip_term(inputs: Mamba2Inputs) -> torch.Tensor:
    """D x: what a Mamba2 layer adds to the recurrence's outputs."""
    return inputs.skip


FAMILY = LinearFamily("mamba2", Mamba2Mixer, KERNELS, Family.SCALAR, qkvg, "mamba", mamba_sources, skip=skip_term)
