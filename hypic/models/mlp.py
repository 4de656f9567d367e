"""Feed-forward blocks: dense SwiGLU MLP and the sparse MoE with a gated shared expert."""
import functools

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert (Qwen3-Next / Qwen3.5-MoE); without the
    shared expert when ``shared_size`` is 0 (MiniMax), or with an ungated one (Granite)."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_size: int, shared_size: int, norm_topk: bool,
                 shared_gated: bool = True) -> None:
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * expert_size, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, expert_size))
        if shared_size:
            self.shared_expert = MLP(hidden, shared_size)
        if shared_size and shared_gated:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]. Token-expert pairs are sorted by expert, so that each expert's
        inputs are one contiguous slice of the sorted pairs."""
        weights, experts = self._route(x)
        flat = experts.flatten()  # pair p = token p // top_k, slot p % top_k
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0])
        routed = expert_outputs(x[tokens], counts, self.gate_up_proj, self.down_proj, grouped_mm_runs(x))
        routed *= weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, tokens, routed)
        if not hasattr(self, "shared_expert"):
            return out
        if not hasattr(self, "shared_expert_gate"):  # Granite: the shared MLP is added as it is
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


def expert_outputs(inputs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   grouped: bool) -> torch.Tensor:
    """SwiGLU experts over inputs [P, hidden] sorted by expert (counts [E] rows each); gate_up
    [E, 2I, hidden], down [E, hidden, I] -> [P, hidden]. ``grouped``: two grouped matmuls, no host
    sync (one launch per projection instead of one per expert); else a loop over the experts."""
    if grouped:
        ends = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(inputs, gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    routed, lo = torch.empty_like(inputs), 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            gate, up = F.linear(inputs[lo : lo + count], gate_up[expert]).chunk(2, dim=-1)
            routed[lo : lo + count] = F.linear(F.silu(gate) * up, down[expert])
            lo += count
    return routed
