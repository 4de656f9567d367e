"""RMS norms of the Qwen3-Next / Qwen3.5, MiniMax, Kimi-Linear and Ring-linear families."""
import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import TensorParallel, all_reduce


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm ``x / rms(x) * (1 + w)`` computed in fp32 (Qwen3-Next / Qwen3.5), or with
    ``unit_offset=False`` the plain ``w * (x / rms(x))``, the weight applied in x's dtype (MiniMax), or
    with ``weight_in_fp32`` before the cast back (Nemotron-H: they differ in half precision)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = True, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps, self.unit_offset, self.weight_in_fp32 = eps, unit_offset, weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(self.mean_square(x.float()) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * y).type_as(x)
        if not self.unit_offset:
            return self.weight * y.type_as(x)
        return (y * (1.0 + self.weight.float())).type_as(x)

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of x's squares over its last dimension (fp32 x [..., dim] -> [..., 1])."""
        return x.pow(2).mean(-1, keepdim=True)


class ShardedRMSNorm(RMSNorm):
    """An RMSNorm over a width cut across tensor-parallel ranks (an output norm over all heads): each
    rank holds its slice of x and of the weight, the mean square is the whole width's (the ranks'
    sums of squares all-reduced); one rank alone: a plain RMSNorm."""

    def __init__(self, dim: int, whole_dim: int, eps: float, tp: TensorParallel, unit_offset: bool = True) -> None:
        super().__init__(dim, eps, unit_offset)
        self.whole_dim, self.tp = whole_dim, tp

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().mean_square(x)
        return all_reduce(x.pow(2).sum(-1, keepdim=True), self.tp) / self.whole_dim


class GroupRMSNorm(RMSNorm):
    """The plain ``w * x / rms(x)`` with the mean square taken over each of ``groups`` equal groups of
    channels: Ring-linear's output norm over groups of heads."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__(dim, eps, unit_offset=False)
        self.groups = groups

    def mean_square(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.view(*x.shape[:-1], self.groups, -1)
        return grouped.pow(2).mean(-1, keepdim=True).expand_as(grouped).reshape(x.shape)


class GatedRMSNorm(nn.Module):
    """Output norm of Gated DeltaNet: ``w * x / rms(x) * silu(z)`` per value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


class SigmoidGatedRMSNorm(nn.Module):
    """Output norm of Kimi Delta Attention: ``w * x / rms(x) * sigmoid(z)`` per head, all in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y * torch.sigmoid(gate.float())).to(x.dtype)
