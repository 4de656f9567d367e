"""Which rank this process is, and the two collectives the model needs (over torch.distributed's
default process group: gloo on the CPU, NCCL on GPUs)."""
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group of ``size`` ranks (size 1: no parallelism)."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is not a rank of that group")

    @property
    def enabled(self) -> bool:
        return self.size > 1


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of every rank's ``x`` (partial outputs of a row-parallel projection), summed in fp32 so
    that half-precision partials lose no more than one rounding."""
    if not tp.enabled:
        return x
    total = x.float()
    dist.all_reduce(total)
    return total.to(x.dtype)


def all_gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension, in rank order (vocabulary shards
    of the logits)."""
    if not tp.enabled:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def common_seed(tp: TensorParallel) -> int:
    """A random seed every rank agrees on (rank 0's): an unseeded sample must pick the same token on
    every rank, or the ranks' shards of its state would follow different texts."""
    seed = random.getrandbits(62) if tp.rank == 0 else 0
    return from_rank_zero(seed) if tp.enabled else seed


def from_rank_zero(value: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object; the others pass nothing)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _control_device() -> torch.device:
    """Where a small control tensor must live for the group's backend (NCCL reduces GPU tensors only)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_extremes(values: list[int], tp: TensorParallel) -> tuple[list[int], list[int]]:
    """(minimum, maximum) over the ranks of each of ``values``, in one small all-reduce."""
    if not tp.enabled:
        return list(values), list(values)
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=_control_device())
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    low = both.tolist()
    return low[:len(values)], [-v for v in low[len(values):]]


def on_every_rank(found: bool, tp: TensorParallel) -> bool:
    """Whether every rank ``found`` its copy (a lower tier holds one shard per rank: one rank may miss
    what another holds, and the ranks must treat it alike, or one would run the model alone)."""
    return bool(rank_extremes([int(found)], tp)[0][0]) if tp.enabled else found


def same_on_every_rank(values: list[int], tp: TensorParallel) -> bool:
    """Whether every rank holds the same ``values`` (a lockstep loop's check that the ranks agree)."""
    low, high = rank_extremes(values, tp)
    return low == high
