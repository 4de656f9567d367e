"""Where a model parameter comes from in a checkpoint: one tensor, or several joined or split
(``Source``); the loader fills each parameter through its source, one tensor read at a time."""
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from .safetensors_reader import TensorReader


Shard = Callable[[torch.Tensor], torch.Tensor]  # a full tensor (the parameter's whole-model shape) -> this rank's part


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """No tensor parallelism: the rank holds the whole tensor."""
    return tensor


@dataclass(frozen=True)
class Direct:
    """The parameter is one checkpoint tensor (reshaped: conv1d weights drop their channel axis;
    ``transposed``: a stack of matrices stored as x @ W, [E, I, H] as gpt-oss's down projections,
    ours [E, H, I])."""

    key: str
    transposed: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def fill(self, name: str, param: torch.Tensor, reader: TensorReader, shard: Shard = whole) -> None:
        tensor = reader.read(self.key)
        _copy(name, param, shard(_reshaped(tensor.transpose(1, 2) if self.transposed else tensor, param)))


@dataclass(frozen=True)
class Concatenated:
    """Tensors laid end to end along their rows: Kimi-Linear's q, k and v convs form our one conv."""

    parts: tuple[str, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return self.parts

    def fill(self, name: str, param: torch.Tensor, reader: TensorReader, shard: Shard = whole) -> None:
        _copy(name, param, shard(_reshaped(torch.cat([reader.read(k) for k in self.parts]), param)))


@dataclass(frozen=True)
class RowHalf:
    """One half (``first`` or not) of a tensor's rows: Granite's shared MLP packs [gate | up] in one."""

    key: str
    first: bool

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def fill(self, name: str, param: torch.Tensor, reader: TensorReader, shard: Shard = whole) -> None:
        gate, up = reader.read(self.key).chunk(2, dim=0)
        _copy(name, param, shard(gate if self.first else up))


@dataclass(frozen=True)
class RowSlice:
    """Rows [start, stop) of a tensor: Ring-linear's fused attention projection holds q, k and v."""

    key: str
    start: int
    stop: int

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def fill(self, name: str, param: torch.Tensor, reader: TensorReader, shard: Shard = whole) -> None:
        _copy(name, param, shard(reader.read(self.key)[self.start : self.stop]))


@dataclass(frozen=True)
class PackedPart:
    """Qwen3-Next packs q, k, v, z (and b, a) per key-head group; ``part`` of that, in conv order."""

    key: str
    part: str  # qkv | z | b | a
    groups: int
    sizes: tuple[int, ...]  # split of one group's rows

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def fill(self, name: str, param: torch.Tensor, reader: TensorReader, shard: Shard = whole) -> None:
        tensor = reader.read(self.key)
        try:
            pieces = tensor.view(self.groups, -1, tensor.shape[-1]).split(self.sizes, dim=1)
        except RuntimeError:
            raise CheckpointError(f"tensor {self.key} has shape {tuple(tensor.shape)}, which the config cannot "
                                  "split into its heads") from None
        flat = [p.reshape(-1, tensor.shape[-1]) for p in pieces]
        chosen = {"qkv": flat[:3], "z": flat[3:4], "b": flat[:1], "a": flat[1:2]}[self.part]
        _copy(name, param, shard(torch.cat(chosen)))


@dataclass(frozen=True)
class ExpertStack:
    """Per-expert tensors stacked into [E, ...]; each expert row may concatenate several (gate | up)."""

    experts: tuple[tuple[str, ...], ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for keys in self.experts for k in keys)

    def fill(self, name: str, param: torch.Tensor, reader: TensorReader, shard: Shard = whole) -> None:
        if len(self.experts) != param.shape[0]:
            raise CheckpointError(f"{name} has {len(self.experts)} experts, the config expects {param.shape[0]}")
        for expert, keys in enumerate(self.experts):
            _copy(f"{name}[{expert}]", param[expert], shard(torch.cat([reader.read(k) for k in keys])[None])[0])


@dataclass(frozen=True)
class Deinterleaved:
    """gpt-oss's fused experts: gate and up in alternating columns of [E, H, 2I] (weights, ``transposed``
    into our [E, 2I, H]) or [E, 2I] (biases); ours hold [gate | up] rows."""

    key: str
    transposed: bool

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.key,)

    def fill(self, name: str, param: torch.Tensor, reader: TensorReader, shard: Shard = whole) -> None:
        tensor = reader.read(self.key)
        tensor = tensor.transpose(1, 2) if self.transposed else tensor
        _copy(name, param, shard(torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)))


Source = Direct | Concatenated | RowHalf | RowSlice | PackedPart | ExpertStack | Deinterleaved


def _reshaped(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 3 and param.dim() == 2 and tensor.shape[1] == 1:  # conv1d [C, 1, k] -> [C, k]
        return tensor[:, 0]
    return tensor


def _copy(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, the config expects {tuple(param.shape)}")
    param.copy_(tensor)
