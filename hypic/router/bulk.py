"""A segment entry as one flat byte buffer plus a header (the entry with a ``TensorSpec`` in place of
each tensor) that says how to cut the buffer back into tensors. The header is small and travels
with Ray; the buffer travels point-to-point (``router/channel.py``)."""
import math
from dataclasses import dataclass

import torch

from hypic.cache.store import SegmentEntry, entry_tensors, with_tensors


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor will be: its dtype and shape (checked like a tensor by ``check_entry``)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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
