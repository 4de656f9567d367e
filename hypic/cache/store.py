"""The public pool: per-segment cache entries shared by every request.

Key = hash(model fingerprint, seams, role, token ids); the token ids are compared on every hit so
a hash collision can never splice the wrong document.
"""
import hashlib
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import Any, Callable, Protocol

import torch

from ..parallel.group import TensorParallel, on_every_rank
from ..state import tensor_bytes
from .arena import StateArenas
from .composition import Transition
from .eviction import Eviction, eviction_order
from .segments import Seams


class Role(str, Enum):
    """How a PIC segment's interior was cut: HYPIC's seams or the naive baseline's whole segment."""

    SEGMENT = "segment"
    NAIVE_SEGMENT = "naive_segment"  # the naive-addition baseline's whole-segment cache


@dataclass
class LinearInterior:
    """(T_C, S_C|0) over a segment's interior plus the interior's trailing conv window. The naive
    baseline's entries hold no transition (None): it composes by addition. ``owner``: the public
    pool's slot that T_C and S_C|0 view once stored (kept alive with them; the conv tail, small and
    handed on into requests' states, stays a tensor of its own)."""

    transition: Transition | None
    zero_start_state: torch.Tensor  # [Hv, K, V], fp32 unless stored narrower (``stored_as``)
    conv_tail: torch.Tensor  # [k-1, C] pre-conv inputs of the interior's last k-1 tokens
    owner: object = field(default=None, repr=False, compare=False)

    def stored_as(self, dtype: torch.dtype, flag_decayed: bool = True) -> "LinearInterior":
        """The entry with T_C and S_C|0 kept in ``dtype`` (the public pool's storage precision), and
        T_C's decayed heads (exactly zero in ``dtype``) flagged, not stored, if ``flag_decayed``."""
        transition = None if self.transition is None else self.transition.with_value(self.transition.value.to(dtype))
        if transition is not None and flag_decayed:
            transition = transition.without_decayed()
        zero_start = self.zero_start_state.to(dtype)
        return LinearInterior(transition, zero_start, self.conv_tail,
                              self.owner if _same_memory(zero_start, self.zero_start_state) else None)

    def placed(self, arenas: StateArenas) -> "LinearInterior":
        """A copy with T_C and S_C|0 in one slot of ``arenas`` (the pool's memory, reused)."""
        tensors = (self.zero_start_state,) if self.transition is None else (self.zero_start_state, self.transition.value)
        slot = arenas.copy(*tensors)
        views = slot.views()
        transition = None if self.transition is None else self.transition.with_value(views[1])
        return LinearInterior(transition, views[0], self.conv_tail, slot)

    def __getstate__(self) -> dict:
        """Pickled with copies when T_C and S_C|0 view a slot (a view would carry its whole slab)."""
        if self.owner is None:
            return self.__dict__
        transition = None if self.transition is None else self.transition.with_value(self.transition.value.clone())
        return {"transition": transition, "zero_start_state": self.zero_start_state.clone(),
                "conv_tail": self.conv_tail, "owner": None}

    def for_compute(self) -> tuple[Transition | None, torch.Tensor]:
        """(T_C, S_C|0) in fp32, whatever they are stored in: composition always computes in fp32."""
        transition = None if self.transition is None else self.transition.with_value(self.transition.value.float())
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
    """``entry`` with its tensors replaced, in ``entry_tensors`` order, by ``tensors`` (or by anything
    standing for them: a transfer's header holds their shapes)."""
    supply = iter(tensors)
    layers = [_layer_with(layer, supply) for layer in entry.layers]
    if next(supply, None) is not None:
        raise ValueError("more tensors than the entry has")
    return replace(entry, layers=layers)


def _same_memory(new: Any, old: Any) -> bool:
    """Whether ``new`` is a tensor over tensor ``old``'s memory (a move to where it already is, a detach)."""
    tensors = isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)
    return tensors and new.device == old.device and new.data_ptr() == old.data_ptr()


def _layer_with(layer: Any, supply: Iterator[Any]) -> Any:
    if isinstance(layer, LinearInterior):
        transition = None if layer.transition is None else layer.transition.with_value(next(supply))
        zero_start = next(supply)
        kept = _same_memory(zero_start, layer.zero_start_state)  # handed back as it was: still the slot's
        return LinearInterior(transition, zero_start, next(supply), layer.owner if kept else None)
    if isinstance(layer, AttentionInterior):
        return AttentionInterior(next(supply), next(supply))
    raise TypeError(f"cannot pack a {type(layer).__name__} layer")


class Event(str, Enum):
    """What happened to an entry in memory (what a lower tier's write policy reacts to)."""

    MADE = "made"  # built here or received from a peer
    HIT = "hit"
    EVICTED = "evicted"
    CLOSING = "closing"  # the server stops gracefully


Load = tuple[Future, float]  # a background load, and until when (time.monotonic) a request waits for it


class HoldingsListener(Protocol):
    """Told of every change in where this server holds a document's entry, on the thread that made
    it (``tier``: ``MEMORY_TIER`` or a lower tier's name): what a router's index is kept by."""

    def stored(self, key: str, namespace: str, tier: str, tokens: int) -> None: ...
    def removed(self, key: str, namespace: str, tier: str) -> None: ...


class Unheard:
    """The listener of a pool nobody follows."""

    def stored(self, key: str, namespace: str, tier: str, tokens: int) -> None:
        pass

    def removed(self, key: str, namespace: str, tier: str) -> None:
        pass


class LowerTiers(Protocol):
    """Where memory's misses are looked up and its entries written (``hypic.cache.tiers.StorageTiers``,
    behind ``HostTier`` on a GPU server with host memory as L2)."""

    def place_loads_in(self, arenas: StateArenas) -> None: ...  # the pool's slots: loads decode straight into them
    def take(self, key: str, token_ids: tuple[int, ...], namespace: str) -> tuple[SegmentEntry, str] | None: ...
    def prefetch(self, key: str, token_ids: tuple[int, ...], namespace: str, expected_bytes: int) -> Load | None: ...
    def offer(self, entry: SegmentEntry, event: Event, origin: str = "") -> None: ...
    def indexed(self, key: str, namespace: str) -> bool: ...  # held per a local index (no I/O: estimates)
    def flush(self, names: set[str], namespace: str | None = None) -> dict[str, int]: ...
    def listen(self, listener: HoldingsListener) -> None: ...  # told what each tier stores and drops
    def held(self) -> Iterator[tuple[str, str, str, int]]: ...  # (key, namespace, tier, tokens) found held
    def close(self) -> None: ...
    def describe(self) -> dict: ...


MEMORY_TIER = "device"  # the tier name of memory hits (on a CPU server the device is host memory)


class SegmentStore:
    """The public pool: whole entries under a byte budget, evicted least recently used first (or by
    ``Eviction.COST``, see ``hypic.cache.eviction``); pinned entries are never evicted.

    An entry that cannot fit (larger than the budget, or the room is held by pinned entries) is
    not stored; the request that built it still uses it. Sizes are exact tensor bytes. ``tp``: the
    tensor-parallel group this pool is one rank's shard of (a lower tier's hit counts only when every
    rank found its shard).
    """

    def __init__(self, budget_bytes: int | None = None, lower: LowerTiers | None = None,
                 eviction: Eviction = Eviction.LRU, tp: TensorParallel = TensorParallel()) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes, self.lower, self.tp = budget_bytes, lower, tp
        self.entries: dict[str, SegmentEntry] = {}
        self.order = eviction_order(eviction)
        self.rebuild_cost: Callable[[SegmentEntry], float] = lambda entry: float(len(entry.token_ids))  # set by the engine
        self.pins: Counter[str] = Counter()
        self.arenas = StateArenas()  # the linear layers' (T_C, S_C|0): fixed-size slots, reused
        if lower is not None:
            lower.place_loads_in(self.arenas)  # a lower tier's hit lands in them: stored with no second copy
        self.nbytes = self.pinned_bytes = 0  # pinned_bytes: of stored entries in use (never evicted)
        self.hits = self.misses = self.evictions = self.rejected = 0
        self.listener: HoldingsListener = Unheard()

    def listen(self, listener: HoldingsListener) -> None:
        """Tell ``listener`` of every entry stored in and dropped from memory and the tiers below."""
        self.listener = listener
        if self.lower is not None:
            self.lower.listen(listener)

    def get(self, key: str, token_ids: tuple[int, ...], namespace: str = "") -> SegmentEntry | None:
        """The entry for ``key`` (of cache ``namespace``) if its token ids are exactly ``token_ids``;
        marks it recently used."""
        return self.fetch(key, token_ids, namespace)[0]

    def fetch(self, key: str, token_ids: tuple[int, ...], namespace: str = "") -> tuple[SegmentEntry | None, str]:
        """``get``, and the tier that held the entry (``MEMORY_TIER``, a lower tier's name, "" on a
        miss). An entry loaded from a lower tier is kept in memory if it fits."""
        entry = self.entries.get(key)
        if entry is not None and entry.token_ids == token_ids:
            self.hits += 1
            self._touch(entry)
            if self.lower is not None:
                self.lower.offer(entry, Event.HIT)
            return entry, MEMORY_TIER
        self.misses += 1
        if self.lower is None:
            return None, ""
        found = self.lower.take(key, token_ids, namespace)
        if not on_every_rank(found is not None, self.tp) or found is None:
            return None, ""  # a rank that found its shard while another did not builds it too, alike
        entry, tier = found
        if self._store(entry):  # not kept (no room): its slots go back once the request drops it
            entry = self.entries[key]  # the stored one, in the pool's slots (a load decodes there: no copy)
            self.lower.offer(entry, Event.MADE, origin=tier)  # type: ignore[union-attr]
        return entry, tier

    def peek(self, key: str, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        """``get`` without counting it or touching the LRU order (for estimates)."""
        entry = self.entries.get(key)
        return entry if entry is not None and entry.token_ids == token_ids else None

    def keys(self) -> frozenset[str]:
        """The keys of every entry held in memory (what a router's index of this pool syncs on)."""
        return frozenset(self.entries)

    def held(self, keys: list[str]) -> list[SegmentEntry]:
        """The entries of ``keys`` held in memory, in that order (evicted ones left out), without
        counting or touching them (what is shipped to a peer)."""
        return [entry for key in keys if (entry := self.entries.get(key)) is not None]

    @property
    def pinned(self) -> int:
        """Entries held in memory that are in use (never evicted)."""
        return sum(1 for key in self.pins if key in self.entries)

    def put(self, entry: SegmentEntry) -> bool:
        """Insert a complete entry, evicting unpinned ones in the eviction order; False if it does not
        fit. The lower tiers are offered it (whether it fits in memory or not)."""
        if entry.key in self.entries:
            return True
        if self.lower is not None:
            self.lower.offer(entry, Event.MADE)
        return self._store(entry)

    def put_in_room(self, entry: SegmentEntry) -> bool:
        """Insert an entry only if it fits beside what is held, evicting nothing (a copy of what
        another pool holds must not push out what only this one holds); not offered below."""
        if entry.key in self.entries:
            return True
        if self.budget_bytes is not None and self.nbytes + entry.nbytes > self.budget_bytes:
            return False
        return self._store(entry)

    def _store(self, entry: SegmentEntry) -> bool:
        size = entry.nbytes
        if not self._make_room(size):
            self.rejected += 1
            return False
        self.entries[entry.key] = entry = self._placed(entry)
        self.nbytes += size
        self.pinned_bytes += size if self.pins[entry.key] else 0
        self._touch(entry)
        self.listener.stored(entry.key, entry.namespace, MEMORY_TIER, len(entry.token_ids))
        return True

    def _placed(self, entry: SegmentEntry) -> SegmentEntry:
        """``entry`` with its linear layers' T_C and S_C|0 in the pool's slots (the rest as it is); a
        layer already in one of them (decoded there by a lower tier's load) is kept as it is."""
        layers = [layer.placed(self.arenas) if isinstance(layer, LinearInterior) and not self.arenas.holds(layer.owner)
                  else layer for layer in entry.layers]
        return replace(entry, layers=layers)

    def _touch(self, entry: SegmentEntry) -> None:
        self.order.touch(entry.key, self.rebuild_cost(entry) / max(entry.nbytes, 1))

    def _make_room(self, size: int) -> bool:
        """Evict unpinned entries in the eviction order until ``size`` more bytes fit; False (and
        nothing evicted) if the pinned ones leave too little room."""
        if self.budget_bytes is None:
            return True
        if self.pinned_bytes + size > self.budget_bytes:
            return False
        while self.nbytes + size > self.budget_bytes:
            key = self.order.victim(lambda k: self.pins[k] > 0)
            assert key is not None  # the check above leaves enough unpinned bytes
            evicted = self._remove(key, evicted=True)
            self.evictions += 1
            if self.lower is not None:
                self.lower.offer(evicted, Event.EVICTED)
        return True

    def _remove(self, key: str, evicted: bool = False) -> SegmentEntry:
        entry = self.entries.pop(key)
        self.nbytes -= entry.nbytes
        self.order.forget(key, evicted)
        self.listener.removed(key, entry.namespace, MEMORY_TIER)
        return entry

    def close(self) -> None:
        """Offer every entry to the lower tiers as memory goes away (``write_back`` writes them)."""
        if self.lower is not None:
            for entry in self.entries.values():
                self.lower.offer(entry, Event.CLOSING)

    def pin(self, key: str) -> None:
        """Mark an entry in use (a no-op count for keys not stored: the request holds its own copy)."""
        self.pins[key] += 1
        if self.pins[key] == 1 and key in self.entries:
            self.pinned_bytes += self.entries[key].nbytes

    def unpin(self, key: str) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]
            if key in self.entries:
                self.pinned_bytes -= self.entries[key].nbytes

    def clear(self, namespace: str | None = None) -> int:
        """Drop every unpinned entry (of cache ``namespace`` only, if given); returns how many were dropped."""
        dropped = [key for key, entry in self.entries.items()
                   if not self.pins[key] and (namespace is None or entry.namespace == namespace)]
        for key in dropped:
            self._remove(key)
        return len(dropped)

    def __len__(self) -> int:
        return len(self.entries)
