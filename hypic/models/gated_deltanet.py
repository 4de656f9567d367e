"""Gated DeltaNet token mixer: causal conv1d, then the gated delta rule over value heads."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kernels.gated_delta import gated_delta_rule
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
class MixerOutput:
    """Result of running a Gated DeltaNet layer over one run of tokens."""

    output: torch.Tensor  # [N, hidden]
    state: torch.Tensor  # [Hv, K, V] fp32, after the run
    conv_state: torch.Tensor  # [k-1, C] pre-conv inputs of the last k-1 tokens
    pre_conv: torch.Tensor  # [N, C]
    inputs: RecurrenceInputs
    cut_states: list[tuple[torch.Tensor, torch.Tensor]]  # (state, conv window) after each requested cut


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's l2norm: x / sqrt(sum x^2 + eps), in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Canonical layout: ``in_proj_qkv`` -> [q | k | v] channels (the conv's order), z, b, a."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel = config.linear_conv_kernel_dim
        channels = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        self.in_proj_qkv = nn.Linear(config.hidden_size, channels, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_heads * self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(channels, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_heads * self.value_dim, config.hidden_size, bias=False)

    @property
    def channels(self) -> int:
        return self.conv_weight.shape[0]

    def convolve(self, pre_conv: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal depthwise conv + SiLU. pre_conv [N, C]; conv_state [k-1, C] (the previous inputs).
        Returns post-conv [N, C] and the new conv state."""
        window = torch.cat([conv_state.to(pre_conv.dtype), pre_conv], dim=0)
        out = F.conv1d(window.T[None], self.conv_weight[:, None, :], groups=self.channels)[0].T
        return F.silu(out), window[-(self.kernel - 1) :]

    def recurrence_inputs(self, post_conv: torch.Tensor, x: torch.Tensor) -> RecurrenceInputs:
        """Split the conv output into q, k, v and compute the per-value-head gates from x."""
        n, ratio = post_conv.shape[0], self.value_heads // self.key_heads
        q, k, v = post_conv.split([self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim], -1)
        q = l2_normalize(q.view(n, self.key_heads, self.key_dim)).repeat_interleave(ratio, 1)
        k = l2_normalize(k.view(n, self.key_heads, self.key_dim)).repeat_interleave(ratio, 1)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.in_proj_b(x)).float()
        return RecurrenceInputs(q, k, v.reshape(n, self.value_heads, self.value_dim).float(), g, beta)

    def run(self, x: torch.Tensor, state: torch.Tensor, conv_state: torch.Tensor, cuts: tuple[int, ...] = ()) -> MixerOutput:
        """One run of N contiguous tokens x [N, hidden] continuing from (state, conv_state).
        ``cuts``: offsets 0 < c < N after which the (state, conv window) is also returned; only the
        recurrence is split there, the token-wise work runs once for the whole run."""
        pre_conv = self.in_proj_qkv(x)
        post_conv, new_conv_state = self.convolve(pre_conv, conv_state)
        inputs = self.recurrence_inputs(post_conv, x)
        window = torch.cat([conv_state.to(pre_conv.dtype), pre_conv])  # row j: token j - (k-1)
        outputs, cut_states, lo = [], [], 0
        for hi in [*cuts, x.shape[0]]:
            part = inputs.slice(lo, hi)
            o, state = gated_delta_rule(part.q, part.k, part.v, part.g, part.beta, state)
            outputs.append(o)
            if hi < x.shape[0]:
                cut_states.append((state, window[hi : hi + self.kernel - 1]))
            lo = hi
        z = self.in_proj_z(x).view(x.shape[0], self.value_heads, self.value_dim)
        out = self.out_proj(self.norm(torch.cat(outputs).to(x.dtype), z).reshape(x.shape[0], -1))
        return MixerOutput(out, state, new_conv_state, pre_conv, inputs, cut_states)
