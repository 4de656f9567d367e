"""A segment entry as one flat byte buffer plus a header (the entry with a ``TensorSpec`` in place of
each tensor) that says how to cut the buffer back into tensors. The header is small and travels
with Ray; the buffer travels point-to-point (``router/channel.py``)."""
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hypic.cache.composition import Transition
from hypic.cache.store import AttentionInterior, LinearInterior, SegmentEntry


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor will be: its dtype and shape (checked like a tensor by ``check_entry``)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def entry_tensors(entry: SegmentEntry) -> Iterator[Any]:
    """The entry's tensors in a fixed order: per layer T_C (if any), S_C|0, conv tail, or K, V."""
    for layer in entry.layers:
        if isinstance(layer, LinearInterior):
            if layer.transition is not None:
                yield layer.transition.value
            yield from (layer.zero_start_state, layer.conv_tail)
        else:
            yield from (layer.keys, layer.values)


def with_tensors(entry: SegmentEntry, tensors: list[Any]) -> SegmentEntry:
    """``entry`` with its tensors replaced, in ``entry_tensors`` order, by ``tensors``."""
    supply = iter(tensors)
    layers = [_layer_with(layer, supply) for layer in entry.layers]
    if next(supply, None) is not None:
        raise ValueError("more tensors than the entry has")
    return dataclasses.replace(entry, layers=layers)


def _layer_with(layer: Any, supply: Iterator[Any]) -> Any:
    if isinstance(layer, LinearInterior):
        transition = None if layer.transition is None else Transition(layer.transition.family, next(supply))
        return LinearInterior(transition, next(supply), next(supply))
    if isinstance(layer, AttentionInterior):
        return AttentionInterior(next(supply), next(supply))
    raise TypeError(f"cannot pack a {type(layer).__name__} layer")


def header_of(entry: SegmentEntry) -> SegmentEntry:
    """The entry with a ``TensorSpec`` in place of each tensor."""
    return with_tensors(entry, [TensorSpec(t.dtype, tuple(t.shape)) for t in entry_tensors(entry)])


ALIGN = 16  # each tensor starts at a multiple of this, so every dtype can be viewed in place


def pack(entry: SegmentEntry) -> torch.Tensor:
    """Every tensor's bytes, in ``entry_tensors`` order (each ``ALIGN``-aligned), as one flat uint8 CPU tensor."""
    parts = []
    for tensor in entry_tensors(entry):
        data = _as_bytes(tensor)
        parts += [data, torch.zeros(_padded(data.numel()) - data.numel(), dtype=torch.uint8)]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def buffer_bytes(header: SegmentEntry) -> int:
    """The size of the flat buffer a header describes."""
    return sum(_padded(spec.nbytes) for spec in entry_tensors(header))


def unpack(header: SegmentEntry, flat: torch.Tensor) -> SegmentEntry:
    """The entry a header describes, its tensors views into ``flat`` (uint8, ``buffer_bytes`` long)."""
    if flat.dtype != torch.uint8 or flat.numel() != buffer_bytes(header):
        raise ValueError(f"buffer of {flat.numel()} bytes, the header needs {buffer_bytes(header)}")
    tensors, offset = [], 0
    for spec in entry_tensors(header):
        chunk = flat[offset:offset + spec.nbytes]
        tensors.append(chunk.view(spec.dtype).view(spec.shape))
        offset += _padded(spec.nbytes)
    return with_tensors(header, tensors)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
