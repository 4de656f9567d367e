"""The public pool: per-segment cache entries shared by every request.

Key = hash(model fingerprint, seams, role, token ids); the token ids are compared on every hit so
a hash collision can never splice the wrong document.
"""
import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import torch

from .composition import Transition
from .segments import Seams
from .state import tensor_bytes


class Role(str, Enum):
    """How a PIC segment's interior was cut: HYPIC's seams or the naive baseline's whole segment."""

    SEGMENT = "segment"
    NAIVE_SEGMENT = "naive_segment"  # the naive-addition baseline's whole-segment cache


@dataclass
class LinearInterior:
    """(T_C, S_C|0) over a segment's interior plus the interior's trailing conv window. The naive
    baseline's entries hold no transition (None): it composes by addition."""

    transition: Transition | None
    zero_start_state: torch.Tensor  # [Hv, K, V], fp32 unless stored narrower (``stored_as``)
    conv_tail: torch.Tensor  # [k-1, C] pre-conv inputs of the interior's last k-1 tokens

    def stored_as(self, dtype: torch.dtype) -> "LinearInterior":
        """The entry with T_C and S_C|0 kept in ``dtype`` (the public pool's storage precision)."""
        transition = None if self.transition is None else Transition(self.transition.family, self.transition.value.to(dtype))
        return LinearInterior(transition, self.zero_start_state.to(dtype), self.conv_tail)

    def for_compute(self) -> tuple[Transition | None, torch.Tensor]:
        """(T_C, S_C|0) in fp32, whatever they are stored in: composition always computes in fp32."""
        transition = None if self.transition is None else Transition(self.transition.family, self.transition.value.float())
        return transition, self.zero_start_state.float()


@dataclass
class AttentionInterior:
    """Interior K rotated at segment-local positions (first interior token at ``local_start``) and V."""

    keys: torch.Tensor  # [Hkv, n, D]
    values: torch.Tensor  # [Hkv, n, D]


InteriorLayer = LinearInterior | AttentionInterior


def _tensor_bytes(layer: InteriorLayer) -> int:
    if isinstance(layer, LinearInterior):
        tensors = (layer.zero_start_state, layer.conv_tail)
        transition = layer.transition.nbytes if layer.transition is not None else 0
        return transition + tensor_bytes(*tensors)
    return tensor_bytes(layer.keys, layer.values)


@dataclass
class SegmentEntry:
    """A cached PIC segment: its interior [local_start, local_start + length) of every layer."""

    key: str
    token_ids: tuple[int, ...]
    seams: Seams
    local_start: int
    length: int
    layers: list[InteriorLayer]
    namespace: str = ""  # the cache namespace it was built in (part of its key)

    @cached_property
    def nbytes(self) -> int:
        return sum(_tensor_bytes(layer) for layer in self.layers)


def entry_key(fingerprint: str, seams: Seams, role: Role, token_ids: tuple[int, ...], namespace: str = "") -> str:
    """Content address of a cached part in cache ``namespace`` ("": shared)."""
    scope = f"ns={namespace}|" if namespace else ""
    digest = hashlib.sha256(f"{fingerprint}|{seams.head},{seams.tail}|{role.value}|{scope}".encode())
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.hexdigest()


class SegmentStore:
    """The public pool: LRU over whole entries under a byte budget; pinned entries are never evicted.

    An entry that cannot fit (larger than the budget, or the room is held by pinned entries) is
    not stored; the request that built it still uses it. Sizes are exact tensor bytes.
    """

    def __init__(self, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[str, SegmentEntry] = OrderedDict()
        self.pins: Counter[str] = Counter()
        self.nbytes = 0
        self.hits = self.misses = self.evictions = self.rejected = 0

    def get(self, key: str, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        """The entry for ``key`` if its token ids are exactly ``token_ids``; marks it recently used."""
        entry = self.entries.get(key)
        if entry is None or entry.token_ids != token_ids:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return entry

    def peek(self, key: str, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        """``get`` without counting it or touching the LRU order (for estimates)."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.token_ids == token_ids else None

    def put(self, entry: SegmentEntry) -> bool:
        """Insert a complete entry, evicting least recently used unpinned ones; False if it does not fit."""
        if entry.key in self.entries:
            return True
        size = entry.nbytes
        if not self._make_room(size):
            self.rejected += 1
            return False
        self.entries[entry.key] = entry
        self.nbytes += size
        return True

    def _make_room(self, size: int) -> bool:
        if self.budget_bytes is None:
            return True
        unpinned = [key for key in self.entries if not self.pins[key]]  # oldest first
        freeable = sum(self.entries[key].nbytes for key in unpinned)
        if self.nbytes - freeable + size > self.budget_bytes:
            return False
        for key in unpinned:
            if self.nbytes + size <= self.budget_bytes:
                break
            self._remove(key)
            self.evictions += 1
        return True

    def _remove(self, key: str) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    def pin(self, key: str) -> None:
        """Mark an entry in use (a no-op count for keys not stored: the request holds its own copy)."""
        self.pins[key] += 1

    def unpin(self, key: str) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]

    def clear(self, namespace: str | None = None) -> int:
        """Drop every unpinned entry (of cache ``namespace`` only, if given); returns how many were dropped."""
        dropped = [key for key, entry in self.entries.items()
                   if not self.pins[key] and (namespace is None or entry.namespace == namespace)]
        for key in dropped:
            self._remove(key)
        return len(dropped)

    def __len__(self) -> int:
        return len(self.entries)
