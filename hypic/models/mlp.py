"""Feed-forward blocks: dense SwiGLU MLP and the sparse MoE with a gated shared expert."""
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
    """Top-k routed experts plus a sigmoid-gated shared expert (Qwen3-Next / Qwen3.5-MoE)."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_size: int, shared_size: int, norm_topk: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * expert_size, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, expert_size))
        self.shared_expert = MLP(hidden, shared_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]. Token-expert pairs are sorted by expert so each expert runs
        one matmul per projection over a contiguous slice (one host sync for all the counts)."""
        weights, experts = self._route(x)
        flat = experts.flatten()  # pair p = token p // top_k, slot p % top_k
        order = flat.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        routed = torch.empty(order.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        inputs, lo = x[tokens], 0
        for expert, count in enumerate(counts):
            if count:
                gate, up = F.linear(inputs[lo : lo + count], self.gate_up_proj[expert]).chunk(2, dim=-1)
                routed[lo : lo + count] = F.linear(F.silu(gate) * up, self.down_proj[expert])
                lo += count
        routed *= weights.flatten()[order, None]
        out = torch.zeros_like(x).index_add_(0, tokens, routed)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
