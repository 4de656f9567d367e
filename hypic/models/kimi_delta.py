"""Kimi Delta Attention (KDA, Kimi-Linear's linear layers): the gated delta rule with a decay per key
channel, S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T, o_t = K^-1/2 S_t^T q_t.

q, k, v come out of a short causal conv + SiLU over three separate projections, q and k are
l2-normalised; g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias) per head and key channel;
b = sigmoid(b_proj x); the output is an RMS norm per head gated by sigmoid(g_b(g_a(x))). T_C is
dense ([H, K, K]), composed like Gated DeltaNet's. Bailing-hybrid's layers (``config.kda_gates``)
project both gates at full rank (f_proj, g_proj) and bound the decay: g = lower_bound x
sigmoid(exp(A_log) (f + dt_bias)).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.composition import Family, Transition
from ..config import ModelConfig
from ..kernels.kimi_delta import KERNELS, kimi_delta_rule, kimi_delta_rule_with_transition, kimi_delta_step
from ..parallel.sharding import Rule, Split
from ..loading.tensor_sources import Concatenated, Direct, Source
from .gated_deltanet import l2_normalize
from .linear import LinearFamily, RunRecurrence, causal_conv, causal_conv_step, qkvg_beta, recur_in_parts
from .norm import SigmoidGatedRMSNorm


@dataclass
class KDAProjections:
    """The token-wise inputs of a KDA layer for N tokens."""

    pre_conv: torch.Tensor  # [N, C] conv inputs [q | k | v]
    gate: torch.Tensor  # [N, H, V] output gate (before its sigmoid)
    g: torch.Tensor  # [N, H, K] fp32 log decay per key channel
    beta: torch.Tensor  # [N, H] fp32 write strength


@dataclass
class KDAInputs:
    q: torch.Tensor  # [N, H, K] l2-normalised
    k: torch.Tensor  # [N, H, K] l2-normalised
    v: torch.Tensor  # [N, H, V]
    g: torch.Tensor  # [N, H, K]
    beta: torch.Tensor  # [N, H]

    def slice(self, lo: int, hi: int) -> "KDAInputs":
        return KDAInputs(self.q[lo:hi], self.k[lo:hi], self.v[lo:hi], self.g[lo:hi], self.beta[lo:hi])


class KimiDeltaAttention(nn.Module):
    """A ``linear.LinearMixer`` with dense transitions; parameters named as in Kimi-Linear's checkpoints
    (but the three q, k, v convs, held as one [3 H K, k] weight)."""

    rotates_state = False

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        hidden, self.heads, self.dim = config.hidden_size, config.linear_num_value_heads, config.linear_key_head_dim
        width, self.kernel = self.heads * self.dim, config.linear_conv_kernel_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, width, bias=False) for _ in range(3))
        self.conv_weight = nn.Parameter(torch.zeros(3 * width, self.kernel))  # the checkpoint's q_, k_, v_conv1d
        self.gates = config.kda_gates
        if self.gates.full_rank:
            self.f_proj, self.g_proj = nn.Linear(hidden, width, bias=False), nn.Linear(hidden, width, bias=False)
            self.A_log = nn.Parameter(torch.zeros(self.heads))  # the checkpoint's shape
        else:
            self.f_a_proj = nn.Linear(hidden, self.dim, bias=False)  # forget gate: low rank, then per key channel
            self.f_b_proj = nn.Linear(self.dim, width, bias=False)
            self.g_a_proj = nn.Linear(hidden, self.dim, bias=False)
            self.g_b_proj = nn.Linear(self.dim, width, bias=False)
            self.A_log = nn.Parameter(torch.zeros(1, 1, self.heads, 1))  # the checkpoint's shape
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.b_proj = nn.Linear(hidden, self.heads, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.dim, config.rms_norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)
        self.whole_heads = config.whole.linear_num_value_heads

    def tp_rules(self) -> dict[str, Rule]:
        """Cut by heads: q, k, v, their conv, both gates' per-channel projections (the low-rank f_a, g_a
        are replicated), dt_bias, A_log and b per head; the output projection's columns by head."""
        channels, per_head = Split(0, ((self.whole_heads, self.dim),)), Split(0, ((self.whole_heads, 1),))
        gates = ("f_proj", "g_proj") if self.gates.full_rank else ("f_b_proj", "g_b_proj")
        return {"q_proj.weight": channels, "k_proj.weight": channels, "v_proj.weight": channels,
                "conv_weight": Split(0, ((self.whole_heads, self.dim),) * 3),
                **{f"{gate}.weight": channels for gate in gates}, "dt_bias": channels, "b_proj.weight": per_head,
                "A_log": per_head if self.gates.full_rank else Split(2, ((self.whole_heads, 1),)),
                "o_proj.weight": Split(1, ((self.whole_heads, self.dim),))}

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> KDAProjections:
        """Token-wise projections of x [N, hidden]; the same for any grouping of tokens into runs."""
        n = x.shape[0]
        pre_conv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        gate = self.g_proj(x) if self.gates.full_rank else self.g_b_proj(self.g_a_proj(x))
        return KDAProjections(pre_conv, gate.view(n, self.heads, self.dim), self.forget_gate(x),
                              torch.sigmoid(self.b_proj(x).float()))

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """g = -exp(A_log) softplus(f + dt_bias), or lower_bound sigmoid(exp(A_log) (f + dt_bias)), with
        f = f_b(f_a(x)) or f_proj(x): x [N, hidden] -> [N, H, K] fp32."""
        f = self.f_proj(x) if self.gates.full_rank else self.f_b_proj(self.f_a_proj(x))
        raw = (f.float() + self.dt_bias.float()).view(-1, self.heads, self.dim)
        rate = self.A_log.float().exp().view(self.heads, 1)
        if self.gates.lower_bound is not None:
            return self.gates.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw)

    def convolve(self, window: torch.Tensor) -> torch.Tensor:
        return causal_conv(window, self.conv_weight)

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor:
        return causal_conv_step(window, self.conv_weight)

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: KDAProjections) -> KDAInputs:
        """Split the conv output into q, k (l2-normalised in fp32) and v, per head."""
        q, k, v = (part.reshape(-1, self.heads, self.dim) for part in post_conv.chunk(3, dim=-1))
        return KDAInputs(l2_normalize(q), l2_normalize(k), v.float(), proj.g, proj.beta)

    def recur(self, inputs: KDAInputs, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence:
        return recur_in_parts(lambda p, s: kimi_delta_rule(p.q, p.k, p.v, p.g, p.beta, s), inputs, state, cuts)

    def recur_with_transition(self, inputs: KDAInputs,
                              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Transition]:
        """``recur`` over one run, also returning its dense transition prod (I - b k k^T) diag(exp g) [H, K, K]."""
        o, state, transition = kimi_delta_rule_with_transition(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta,
                                                               state)
        return o, state, Transition(Family.DENSE, transition)

    def step(self, states: torch.Tensor, inputs: KDAInputs) -> tuple[torch.Tensor, torch.Tensor]:
        return kimi_delta_step(states, inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta)

    def output(self, o: torch.Tensor, proj: KDAProjections, dtype: torch.dtype) -> torch.Tensor:
        """Sigmoid-gated norm per head and output projection: o [N, H, V] -> [N, hidden]."""
        return self.o_proj(self.o_norm(o.to(dtype), proj.gate).reshape(o.shape[0], -1))


CONVS = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


def kda_sources(config: ModelConfig, prefix: str, keys: dict[str, str]) -> dict[str, Source]:
    """A Kimi Delta Attention layer (``keys``: its self_attn tensors): its three convs (q, k, v)
    are our one conv over [q | k | v]; the rest keep their names."""
    out: dict[str, Source] = {f"{prefix}mixer.{n}": Direct(k) for n, k in keys.items() if n not in CONVS}
    if all(name in keys for name in CONVS):
        out[f"{prefix}mixer.conv_weight"] = Concatenated(tuple(keys[name] for name in CONVS))
    return out


FAMILY = LinearFamily("kda", KimiDeltaAttention, KERNELS, Family.DENSE, qkvg_beta, "self_attn", kda_sources)
