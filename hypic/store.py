"""The public pool: per-segment cache entries shared by every request.

Key = hash(model fingerprint, seam width, role, token ids); the token ids are compared on every
hit so a hash collision can never splice the wrong document.
"""
import hashlib
from dataclasses import dataclass, field
from enum import Enum

import torch

from .composition import Transition
from .state import RequestState


class Role(str, Enum):
    """Where a cached part sits in a request: L (position-dependent) or a PIC segment."""

    LEADING = "leading"
    SEGMENT = "segment"
    NAIVE_SEGMENT = "naive_segment"  # the naive-addition baseline's whole-segment cache


@dataclass
class LinearInterior:
    """(T_C, S_C|0) over a segment's interior plus the interior's trailing conv window."""

    transition: Transition
    zero_start_state: torch.Tensor  # [Hv, K, V] fp32
    conv_tail: torch.Tensor  # [k-1, C] pre-conv inputs of the interior's last k-1 tokens


@dataclass
class AttentionInterior:
    """Interior K rotated at segment-local positions (first interior token at ``local_start``) and V."""

    keys: torch.Tensor  # [Hkv, n, D]
    values: torch.Tensor  # [Hkv, n, D]


InteriorLayer = LinearInterior | AttentionInterior


def _tensor_bytes(layer: InteriorLayer) -> int:
    if isinstance(layer, LinearInterior):
        tensors = (layer.zero_start_state, layer.conv_tail)
        return layer.transition.nbytes + sum(t.numel() * t.element_size() for t in tensors)
    return sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))


@dataclass
class SegmentEntry:
    """A cached PIC segment: its interior [local_start, local_start + length) of every layer."""

    key: str
    token_ids: tuple[int, ...]
    seam_width: int
    local_start: int
    length: int
    layers: list[InteriorLayer]

    @property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(layer) for layer in self.layers)


@dataclass
class PrefixEntry:
    """A leading segment cached in full: the running state after it, valid only at position 0."""

    key: str
    token_ids: tuple[int, ...]
    state: RequestState

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


def entry_key(fingerprint: str, seam_width: int, role: Role, token_ids: tuple[int, ...]) -> str:
    """Content address of a cached part."""
    digest = hashlib.sha256(f"{fingerprint}|{seam_width}|{role.value}|".encode())
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()


@dataclass
class SegmentStore:
    """In-memory public pool with hit/miss counters."""

    entries: dict[str, SegmentEntry | PrefixEntry] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def get(self, key: str, token_ids: tuple[int, ...]) -> SegmentEntry | PrefixEntry | None:
        """The entry for ``key`` if its token ids are exactly ``token_ids``."""
        entry = self.entries.get(key)
        if entry is None or entry.token_ids != token_ids:
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def put(self, entry: SegmentEntry | PrefixEntry) -> None:
        """Insert a complete entry (entries are built fully before they are stored)."""
        self.entries[entry.key] = entry

    def clear(self) -> None:
        self.entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)
