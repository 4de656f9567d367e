"""Feed-forward blocks: the dense MLP (SwiGLU, or Nemotron-H's squared ReLU) and the sparse MoE."""
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GroupedSigmoidRouting
from ..parallel.sharding import FirstRank, Rule, Split


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class MLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))``, or with ``activation`` "relu2" the ungated
    ``down(relu(up(x))^2)`` (Nemotron-H)."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu") -> None:
        super().__init__()
        if activation == "silu":
            self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def tp_rules(self) -> dict[str, Rule]:
        """Column-parallel gate and up projections, row-parallel down projection."""
        return {"gate_proj.weight": Split(0), "up_proj.weight": Split(0), "down_proj.weight": Split(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "gate_proj"):
            return self.down_proj(relu_squared(self.up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class ExpertOptions:
    """How a family's MoE differs from Qwen's (softmax top-k, SwiGLU experts, sigmoid-gated shared expert)."""

    shared_gated: bool = True  # False: the shared expert is added as it is (Granite, Kimi-Linear, Nemotron-H)
    routing: GroupedSigmoidRouting | None = None  # DeepSeek-V3's grouped sigmoid router (Kimi-Linear, Nemotron-H)
    activation: str = "silu"  # "relu2": ungated squared-ReLU experts (Nemotron-H)
    latent_size: int | None = None  # experts between two latent projections (Nemotron-H's latent MoE)
    clamp: tuple[float, float] | None = None  # gpt-oss: (alpha, limit) of the clamped SwiGLU
    bias: bool = False  # gpt-oss: biases on the router and on every expert's projections
    tp_size: int = 1  # tensor-parallel ranks the experts' widths are cut over


class SparseMoE(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert (Qwen3-Next / Qwen3.5-MoE); without the
    shared expert when ``shared_size`` is 0 (MiniMax); the other families' variants: ``ExpertOptions``
    (squared-ReLU experts keep ``up_proj`` [E, I, H] instead of ``gate_up_proj`` [E, 2I, H])."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_size: int, shared_size: int, norm_topk: bool,
                 options: ExpertOptions = ExpertOptions()) -> None:
        super().__init__()
        routing, activation, latent_size = options.routing, options.activation, options.latent_size
        self.top_k, self.norm_topk, self.routing, self.activation = top_k, norm_topk, routing, activation
        self.router = nn.Linear(hidden, experts, bias=options.bias)
        self.clamp = options.clamp
        if routing is not None:
            self.router_bias = nn.Parameter(torch.zeros(experts))  # e_score_correction_bias: steers the choice only
        width = hidden if latent_size is None else latent_size
        if latent_size is not None:
            self.fc1_latent_proj = nn.Linear(hidden, latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(latent_size, hidden, bias=False)
        if activation == "silu":
            self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * expert_size, width))
        else:
            self.up_proj = nn.Parameter(torch.zeros(experts, expert_size, width))
        self.down_proj = nn.Parameter(torch.zeros(experts, width, expert_size))
        if options.bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(experts, 2 * expert_size))
            self.down_bias = nn.Parameter(torch.zeros(experts, width))
        if shared_size:
            self.shared_expert = MLP(hidden, shared_size, activation)
        if shared_size and options.shared_gated:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.tp_size = options.tp_size

    def tp_rules(self) -> dict[str, Rule]:
        """Tensor parallel within every expert: each rank holds 1/N of each expert's [gate | up] rows
        and down columns. Routing is replicated, so every rank computes the same choice and its
        partial outputs need one all-reduce, shared expert included; see docs/parallel.md."""
        width = self.down_proj.shape[-1] * self.tp_size  # the whole expert's intermediate size
        up = Split(1, ((width, 1), (width, 1))) if self.activation == "silu" else Split(1)
        return {"gate_up_proj": up, "up_proj": up, "down_proj": Split(2), "gate_up_bias": up,
                "down_bias": FirstRank()}

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.routing is not None:
            return self._route_grouped_sigmoid(x)
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _route_grouped_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores in fp32; experts chosen by score + bias among the ``top_groups`` groups whose
        two best biased scores sum highest; weights: the chosen unbiased scores (renormalised) x scaling."""
        routing, experts = self.routing, self.router_bias.shape[0]
        assert routing is not None
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()
        biased = scores + self.router_bias.float()
        grouped = biased.view(-1, routing.groups, experts // routing.groups)
        best_groups = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1).topk(routing.top_groups, dim=-1)[1]
        allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        biased = biased.masked_fill(~allowed.repeat_interleave(experts // routing.groups, dim=1), float("-inf"))
        chosen = biased.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * routing.scaling).to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]. Token-expert pairs are sorted by expert, so that each expert's
        inputs are one contiguous slice of the sorted pairs."""
        weights, experts = self._route(x)
        flat = experts.flatten()  # pair p = token p // top_k, slot p % top_k
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.down_proj.shape[0])
        inner = self.fc1_latent_proj(x) if hasattr(self, "fc1_latent_proj") else x
        up = self.gate_up_proj if self.activation == "silu" else self.up_proj
        biases = (self.gate_up_bias, self.down_bias, flat[order]) if hasattr(self, "gate_up_bias") else None
        routed = expert_outputs(inner[tokens], counts, up, self.down_proj, grouped_mm_runs(x), self.activation,
                                self.clamp, biases)
        routed *= weights.flatten()[order, None]
        out = torch.zeros_like(inner).index_add_(0, tokens, routed)
        out = self.fc2_latent_proj(out) if hasattr(self, "fc2_latent_proj") else out
        if not hasattr(self, "shared_expert"):
            return out
        if not hasattr(self, "shared_expert_gate"):  # Granite, Kimi-Linear: the shared MLP is added as it is
            return out + self.shared_expert(x)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` multiplies x's dtype on x's device (CUDA: bfloat16 from Hopper
    on; the CPU: any float dtype from torch 2.13; elsewhere the loop over experts)."""
    return _grouped_mm_works(x.device.type, x.dtype)


@functools.cache
def _grouped_mm_works(device: str, dtype: torch.dtype) -> bool:
    """Tried once per device type and dtype on a tiny problem: the support differs by build."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        ones = torch.ones(2, 16, dtype=dtype, device=device)
        torch._grouped_mm(ones, ones.new_ones(1, 16, 16).transpose(1, 2),
                          offs=torch.tensor([2], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _expert_activation(projected: torch.Tensor, activation: str, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """SwiGLU of a [gate | up] projection (gpt-oss's clamped form with ``clamp`` = (alpha, limit):
    (clamp(up, +-limit) + 1) * g sigmoid(alpha g), g = min(gate, limit)), or the squared ReLU of an up projection."""
    if activation != "silu":
        return relu_squared(projected)
    gate, up = projected.chunk(2, dim=-1)
    if clamp is None:
        return F.silu(gate) * up
    alpha, limit = clamp
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


ExpertBiases = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # up bias [E, 2I], down bias [E, H], expert per row [P]


def expert_outputs(inputs: torch.Tensor, counts: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   grouped: bool, activation: str = "silu", clamp: tuple[float, float] | None = None,
                   biases: ExpertBiases | None = None) -> torch.Tensor:
    """Experts over inputs [P, hidden] sorted by expert (counts [E] rows each); up [E, 2I, hidden]
    ([gate | up], SwiGLU) or [E, I, hidden] (squared ReLU), down [E, hidden, I] -> [P, hidden].
    ``grouped``: two grouped matmuls, no host sync (one launch per projection instead of one per
    expert); else a loop over the experts. ``biases``: added after each projection (gpt-oss)."""
    up_bias, down_bias = (biases[0][biases[2]], biases[1][biases[2]]) if biases is not None else (None, None)
    if grouped:
        ends = counts.cumsum(0).to(torch.int32)
        projected = torch._grouped_mm(inputs, up.transpose(1, 2), offs=ends)
        hidden = _expert_activation(projected if up_bias is None else projected + up_bias, activation, clamp)
        out = torch._grouped_mm(hidden, down.transpose(1, 2), offs=ends)
        return out if down_bias is None else out + down_bias
    routed, lo = torch.empty_like(inputs), 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            rows = slice(lo, lo + count)
            projected = F.linear(inputs[rows], up[expert])
            hidden = _expert_activation(projected if up_bias is None else projected + up_bias[rows], activation, clamp)
            out = F.linear(hidden, down[expert])
            routed[rows] = out if down_bias is None else out + down_bias[rows]
            lo += count
    return routed
