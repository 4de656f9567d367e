"""L2: host memory below a GPU's public pool (``--host-cache-size``).

Entries that the device's pool (L1) evicts move here instead of being dropped; an L2 hit moves
back to the device. A request's documents held here start their copy to the device when it
arrives (``prefetch``: non-blocking from pinned memory, so the copy overlaps the loop's other
work); its prefill then takes them. Below L2 the storage tiers (disk, Mooncake) keep their own
write policy for new entries; an entry leaves L2 for them as it would leave memory (write_back).
On a CPU server L1 already is host memory, and this tier is refused there (``hypic serve``).
"""
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..arena import StateArenas
from ..store import Event, HoldingsListener, Load, LowerTiers, SegmentEntry, Unheard, entry_tensors, with_tensors
from .hierarchy import load_rate

MAX_STAGED = 64  # copies to the device started and not yet taken, at most (older ones are dropped)


def to_device(entry: SegmentEntry, device: torch.device) -> SegmentEntry:
    """``entry`` with its tensors copied to ``device``, non-blocking (from pinned memory a GPU copy
    runs asynchronously; kernels that read it later on the same stream wait for it)."""
    return with_tensors(entry, [t.to(device, non_blocking=True) for t in entry_tensors(entry)])


def to_host(entry: SegmentEntry, pin: bool) -> SegmentEntry:
    """``entry`` with its tensors in host memory (``pin``: page-locked, for asynchronous copies back
    to a GPU); the copy completes before it returns (the entry may be written to disk from here)."""
    tensors = [t.to("cpu") for t in entry_tensors(entry)]
    return with_tensors(entry, [t.pin_memory() if pin else t for t in tensors])


@dataclass
class HostCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0


class HostTier:
    """The ``LowerTiers`` of a device pool: entries in host memory under ``budget_bytes`` (least
    recently used leave first, to ``below`` as evictions), in front of the storage tiers ``below``
    (None: none). Driven by the engine loop's thread only."""

    name = "host"

    def __init__(self, budget_bytes: int, device: torch.device | str, below: LowerTiers | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes, self.device, self.below = budget_bytes, torch.device(device), below
        self.pin = self.device.type == "cuda"
        self.entries: OrderedDict[str, SegmentEntry] = OrderedDict()  # least recently used first
        self.staged: OrderedDict[str, SegmentEntry] = OrderedDict()  # on their way to the device
        self.nbytes = 0
        self.counters = HostCounters()
        self.listener: HoldingsListener = Unheard()

    def listen(self, listener: HoldingsListener) -> None:
        self.listener = listener
        if self.below is not None:
            self.below.listen(listener)

    def held(self) -> Iterator[tuple[str, str, str, int]]:
        """What the storage tiers found held at start (host memory starts empty)."""
        return self.below.held() if self.below is not None else iter(())

    # ----- reads ---------------------------------------------------------------------------
    def place_loads_in(self, arenas: StateArenas) -> None:
        """The storage tiers' loads decode into the device pool's slots (host memory's entries are
        copied to the device, then into them)."""
        if self.below is not None:
            self.below.place_loads_in(arenas)

    def take(self, key: str, token_ids: tuple[int, ...], namespace: str) -> tuple[SegmentEntry, str] | None:
        """Entry ``key`` on the device: the copy a prefetch started, or one made now from host
        memory; else what the storage tiers hold (None: nowhere)."""
        entry = self.staged.pop(key, None)
        if entry is None:
            held = self.entries.get(key)
            entry = self._load(held) if held is not None and held.token_ids == token_ids else None
        if entry is not None and entry.token_ids == token_ids:
            self.entries.move_to_end(key)
            self.counters.hits += 1
            return entry, self.name
        self.counters.misses += 1
        return self.below.take(key, token_ids, namespace) if self.below is not None else None

    def prefetch(self, key: str, token_ids: tuple[int, ...], namespace: str, expected_bytes: int) -> Load | None:
        """Start the copy of entry ``key`` to the device if host memory holds it (nothing to wait for:
        the copy is queued on the device), else ask below."""
        held = self.entries.get(key)
        if held is not None and held.token_ids == token_ids:
            if key not in self.staged:
                self.staged[key] = self._load(held)
                while len(self.staged) > MAX_STAGED:
                    self.staged.popitem(last=False)
        elif self.below is not None:
            return self.below.prefetch(key, token_ids, namespace, expected_bytes)
        return None

    def _load(self, entry: SegmentEntry) -> SegmentEntry:
        start = time.perf_counter()
        on_device = to_device(entry, self.device)
        self.counters.loaded_bytes += entry.nbytes
        self.counters.load_seconds += time.perf_counter() - start
        return on_device

    def indexed(self, key: str, namespace: str) -> bool:
        """Whether host memory holds entry ``key``, or a storage tier's local index does."""
        return key in self.entries or (self.below is not None and self.below.indexed(key, namespace))

    def tiers_holding(self, key: str, namespace: str) -> list[str]:
        """The names of the tiers (host memory, then the storage tiers) whose index holds entry ``key``."""
        below = self.below.tiers_holding(key, namespace) if self.below is not None else []  # type: ignore[attr-defined]
        return [self.name] * (key in self.entries) + below

    # ----- writes --------------------------------------------------------------------------
    def offer(self, entry: SegmentEntry, event: Event, origin: str = "") -> None:
        """An entry the device pool evicts comes here (its least recently used ones go below as
        evictions); anything else is the storage tiers' business."""
        if event is Event.EVICTED and entry.nbytes <= self.budget_bytes:
            self._keep(entry)
        elif self.below is not None:
            self.below.offer(entry, event, origin)

    def _keep(self, entry: SegmentEntry) -> None:
        if entry.key in self.entries:
            self.entries.move_to_end(entry.key)
            return
        while self.entries and self.nbytes + entry.nbytes > self.budget_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.counters.evictions += 1
            self.listener.removed(old.key, old.namespace, self.name)
            if self.below is not None:
                self.below.offer(old, Event.EVICTED)
        self.entries[entry.key] = to_host(entry, self.pin)
        self.nbytes += entry.nbytes
        self.listener.stored(entry.key, entry.namespace, self.name, len(entry.token_ids))

    # ----- flush, close, reports -----------------------------------------------------------
    def flush(self, names: set[str], namespace: str | None = None) -> dict[str, int]:
        """A flush of ``memory`` empties host memory too (of cache ``namespace`` only, if given); the
        storage tiers named are flushed below."""
        dropped = {}
        if "memory" in names:
            keys = [k for k, e in self.entries.items() if namespace is None or e.namespace == namespace]
            for key in keys:
                dropped_entry = self.entries.pop(key)
                self.nbytes -= dropped_entry.nbytes
                self.staged.pop(key, None)
                self.listener.removed(key, dropped_entry.namespace, self.name)
            dropped[self.name] = len(keys)
        if self.below is not None:
            dropped.update(self.below.flush(names - {"memory"}, namespace))
        return dropped

    def close(self) -> None:
        """Host memory goes away with the server: its entries are offered below as memory's are."""
        if self.below is not None:
            for entry in self.entries.values():
                self.below.offer(entry, Event.CLOSING)
            self.below.close()

    def describe(self) -> dict:
        """The storage tiers' report with host memory's beside them."""
        report = self.below.describe() if self.below is not None else {
            "write_policy": None, "prefetch_policy": None, "prefetches": {}, "write_queue": 0, "write_queue_bytes": 0,
            "dropped_writes": 0, "tiers": {}}
        host = {"budget_bytes": self.budget_bytes, "bytes": self.nbytes, "entries": len(self.entries),
                "healthy": True, "connecting": False, "state": "healthy", "error": "", **vars(self.counters),
                "load_gb_per_s": load_rate(self.counters.loaded_bytes, self.counters.load_seconds)}
        return {**report, "tiers": {self.name: host, **report.get("tiers", {})}}
