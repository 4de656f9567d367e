"""Which rank this process is, and the collectives of a tensor-parallel group (over torch.distributed's
default process group: gloo on the CPU, NCCL on GPUs). Every collective goes through ``_collective``:
a failure of one (a rank died, timed out, or reached another collective) is the group's failure
(``GroupFailure``), never one request's. The small control collectives carry the name of their call
site, so ranks that reach different ones are told apart instead of mixing their values."""
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class GroupFailure(BaseException):
    """The tensor-parallel group cannot go on: a collective failed, or the ranks reached different
    collectives, or disagree where they must agree. A BaseException, so that no per-request handler
    takes it for one request's error."""


def _collective(what: str, run: Callable[[], T]) -> T:
    """``run()``, a collective; any failure of it ends the group."""
    try:
        return run()
    except GroupFailure:
        raise
    except Exception as err:  # gloo and NCCL report a peer gone, a timeout or a size mismatch this way
        raise GroupFailure(f"the tensor-parallel collective {what} failed on rank {dist.get_rank()} "
                           f"({type(err).__name__}: {err})") from err


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
    _collective("all_reduce", lambda: dist.all_reduce(total))
    return total.to(x.dtype)


def all_gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension, in rank order (vocabulary shards
    of the logits)."""
    if not tp.enabled:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    _collective("all_gather", lambda: dist.all_gather(parts, x.contiguous()))
    return torch.cat(parts, dim=-1)


def common_seed(tp: TensorParallel) -> int:
    """A random seed every rank agrees on (rank 0's): an unseeded sample must pick the same token on
    every rank, or the ranks' shards of its state would follow different texts."""
    seed = random.getrandbits(62) if tp.rank == 0 else 0
    return from_rank_zero(seed) if tp.enabled else seed


def from_rank_zero(value: Any = None) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object; the others pass nothing)."""
    box = [value]
    _collective("broadcast from rank 0", lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def _control_device() -> torch.device:
    """Where a small control tensor must live for the group's backend (NCCL reduces GPU tensors only)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _site_tag(site: str) -> int:
    """A number for a control collective's call site, the same in every process."""
    return zlib.crc32(site.encode()) + 1


def rank_extremes(values: list[int], tp: TensorParallel, site: str) -> tuple[list[int], list[int]]:
    """(minimum, maximum) over the ranks of each of ``values``, in one small all-reduce made at ``site``
    (a name of the call site: ranks at different sites end the group)."""
    if not tp.enabled:
        return list(values), list(values)
    tagged = [_site_tag(site), *values]
    both = torch.tensor([*tagged, *(-v for v in tagged)], dtype=torch.int64, device=_control_device())
    _collective(f"at {site}", lambda: dist.all_reduce(both, op=dist.ReduceOp.MIN))
    low = both.tolist()
    low, high = low[:len(tagged)], [-v for v in low[len(tagged):]]
    if low[0] != high[0]:
        raise GroupFailure(f"the tensor-parallel ranks are out of step: rank {tp.rank} reached {site} while "
                           "another rank was at a different collective")
    return low[1:], high[1:]


def on_every_rank(found: bool, tp: TensorParallel, site: str = "a lookup below memory") -> bool:
    """Whether every rank ``found`` its copy (a lower tier holds one shard per rank: one rank may miss
    what another holds, and the ranks must treat it alike, or one would run the model alone)."""
    return bool(rank_extremes([int(found)], tp, site)[0][0]) if tp.enabled else found


def same_on_every_rank(values: list[int], tp: TensorParallel, site: str) -> bool:
    """Whether every rank holds the same ``values`` at ``site`` (the ranks' check that they agree)."""
    low, high = rank_extremes(values, tp, site)
    return low == high
