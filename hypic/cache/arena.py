"""The pools' preallocated memory: fixed-size slots cut from slabs that are
allocated once per slot shape, handed out and taken back without going through the allocator (the
private pool's KV pages and snapshot states, the public pool's (T_C, S_C|0)).

A slot belongs to a ``Slot`` object and returns to its arena when the last reference to that object
goes: Python's reference count is the slot's, so whoever holds a page (a resumed request reading it,
a write-back in flight, the tree) keeps it, however the tree changes meanwhile. A slot given back is
NaN-poisoned at once along its next-to-last dimension in the first head (``_poison_index``: every KV
position, every row of a state; a few hundred elements, and enough to make anything computed from
it NaN): a stale view read after its owner went shows up as NaN, not as numbers that look right. A
slab whose slots are all free goes back to the allocator (one large block: no fragments left
behind), unless it is the arena's last.
"""
import math
import sys
import threading
from dataclasses import dataclass

import torch

SLAB_BYTES = 8 << 20  # a slab's size (at least one slot): large enough to be its own mapping


@dataclass(frozen=True)
class Field:
    """One tensor of every slot: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _poison_index(shape: tuple[int, ...]) -> tuple:
    """Where a freed slot of ``shape`` is poisoned: element 0 of the last dimension along the
    next-to-last, at index 0 of the others (for KV [Hkv, P, D]: every position of the first head)."""
    return (0,) * (len(shape) - 2) + (slice(None), 0) if len(shape) >= 2 else (0,)


class Slot:
    """A slot of ``arena`` (its ``number``), held while this object lives."""

    __slots__ = ("arena", "number")

    def __init__(self, arena: "Arena", number: int) -> None:
        self.arena, self.number = arena, number  # number: None once released

    def views(self) -> tuple[torch.Tensor, ...]:
        """The slot's tensors, one per field (views into the slab: valid while this object lives)."""
        if self.number is None:
            raise ValueError("the slot was released: its memory is another slot's now")
        return self.arena.views(self.number)

    def release(self) -> None:
        """Give the slot back now, not when this object goes (a load that failed: whatever still
        refers to it, an exception's frames say, reads NaN from here on)."""
        if self.number is not None:
            number, self.number = self.number, None
            self.arena.give_back(number)

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit the arena may be half torn down: nothing to give back to
            self.release()


class Arena:
    """Slots of ``fields`` on ``device``, ``slab_slots`` to a slab; slot n is slot n % slab_slots of
    slab n // slab_slots. Thread-safe: a slot can be given back on any thread."""

    def __init__(self, fields: tuple[Field, ...], device: torch.device, slab_bytes: int = SLAB_BYTES) -> None:
        self.fields, self.device = fields, device
        self.slot_bytes = sum(f.nbytes for f in fields)
        self.slab_slots = max(1, slab_bytes // max(self.slot_bytes, 1))
        self._slabs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._views: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # slab -> each slot's views, made with the slab
        self._free: dict[int, list[int]] = {}  # slab -> its free slot offsets
        self._open: set[int] = set()  # slabs with a free slot
        self._poison = [(i, _poison_index(f.shape)) for i, f in enumerate(fields)
                        if f.dtype.is_floating_point and f.nbytes]  # an empty field (no kept head) has nothing to poison
        self._lock = threading.RLock()  # a page dropped inside ``take`` (a collection) gives back re-entrantly
        self.used = 0

    def take(self) -> Slot:
        """A free slot, from the lowest slab that has one (a new slab if none has); its contents are
        undefined (poisoned)."""
        with self._lock:
            slab = min(self._open) if self._open else self._grow()
            free = self._free[slab]
            offset = free.pop()
            if not free:
                self._open.discard(slab)
            self.used += 1
            return Slot(self, slab * self.slab_slots + offset)

    def _grow(self) -> int:
        slab = next(s for s in range(len(self._slabs) + 1) if s not in self._slabs)
        self._slabs[slab] = tuple(torch.empty(self.slab_slots, *f.shape, dtype=f.dtype, device=self.device)
                                  for f in self.fields)
        # every slot's views cut once (one unbind per field), not one indexing op per slot handed out
        self._views[slab] = list(zip(*(tensor.unbind(0) for tensor in self._slabs[slab])))
        self._free[slab] = list(range(self.slab_slots - 1, -1, -1))
        self._open.add(slab)
        return slab

    def views(self, number: int) -> tuple[torch.Tensor, ...]:
        slab, offset = divmod(number, self.slab_slots)
        return self._views[slab][offset]

    def give_back(self, number: int) -> None:
        """Slot ``number`` is free again: poisoned, and its slab released if it is wholly free."""
        slab, offset = divmod(number, self.slab_slots)
        with self._lock:
            tensors = self._slabs[slab]
            for field, index in self._poison:
                tensors[field][(offset, *index)] = float("nan")
            self._free[slab].append(offset)
            self._open.add(slab)
            self.used -= 1
            if len(self._free[slab]) == self.slab_slots and len(self._slabs) > 1:
                del self._slabs[slab], self._views[slab], self._free[slab]
                self._open.discard(slab)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slabs allocated (used and free slots)."""
        return len(self._slabs) * self.slab_slots * self.slot_bytes


class Page(tuple):
    """``length`` consecutive positions of one attention layer's KV in a slot: a ``KVBlock``
    (keys [Hkv, length, Dk], values [Hkv, length, Dv], views) that holds its slot while it lives."""

    slot: Slot

    @classmethod
    def holding(cls, slot: Slot, length: int) -> "Page":
        keys, values = slot.views()
        page = cls((keys, values) if keys.shape[1] == length else (keys[:, :length], values[:, :length]))
        page.slot = slot
        return page

    @property
    def nbytes(self) -> int:
        """Bytes the page holds in memory: its whole slot, however few positions it uses."""
        return self.slot.arena.slot_bytes


def size_classes(page_tokens: int) -> tuple[int, ...]:
    """Slot sizes in positions, smallest first: ``page_tokens`` and up to three halvings of it (a
    page shorter than a full one, at an edge's ends, takes the smallest class it fits: < 2x its rows)."""
    return tuple(sorted({max(1, page_tokens >> k) for k in range(4)}))


class Arenas:
    """Arenas by slot shape, made on first use. Thread-safe (the public pool's loads take slots on
    prefetch threads while the engine loop takes and counts them)."""

    def __init__(self, slab_bytes: int = SLAB_BYTES) -> None:
        self.slab_bytes = slab_bytes
        self.arenas: dict[tuple, Arena] = {}
        self._lock = threading.Lock()

    def arena(self, key: tuple, fields: tuple[Field, ...], device: torch.device) -> Arena:
        with self._lock:
            if key not in self.arenas:
                self.arenas[key] = Arena(fields, device, self.slab_bytes)
            return self.arenas[key]

    def _all(self) -> list[Arena]:
        with self._lock:
            return list(self.arenas.values())

    def holds(self, owner: object) -> bool:
        """Whether ``owner`` is a slot (not released) of one of these arenas."""
        return isinstance(owner, Slot) and owner.number is not None and any(owner.arena is a for a in self._all())

    @property
    def used_slots(self) -> int:
        return sum(arena.used for arena in self._all())

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slabs allocated (used and free slots)."""
        return sum(arena.reserved_bytes for arena in self._all())


class PageArenas(Arenas):
    """One KV ``Arena`` per (device, dtype, heads, key and value widths, size class); full pages are
    ``page_tokens`` positions."""

    def __init__(self, page_tokens: int, slab_bytes: int = SLAB_BYTES) -> None:
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        super().__init__(slab_bytes)
        self.page_tokens, self.classes = page_tokens, size_classes(page_tokens)

    def page(self, keys: torch.Tensor, values: torch.Tensor, copies: "Copies | None" = None) -> Page:
        """A page holding a copy of ``keys`` [Hkv, n, Dk] and ``values`` [Hkv, n, Dv], n <= page_tokens
        (made at once, or with ``copies`` when they are run)."""
        count = keys.shape[1]
        size = next((c for c in self.classes if c >= count), None)
        if size is None or count == 0:
            raise ValueError(f"a page holds 1..{self.page_tokens} positions, got {count}")
        page = Page.holding(self._arena(keys, values, size).take(), count)
        Copies.into(copies, page, (keys, values))
        return page

    def _arena(self, keys: torch.Tensor, values: torch.Tensor, size: int) -> Arena:
        fields = (Field((keys.shape[0], size, keys.shape[2]), keys.dtype),
                  Field((values.shape[0], size, values.shape[2]), values.dtype))
        return self.arena((keys.device, fields), fields, keys.device)


class StateArenas(Arenas):
    """One ``Arena`` per tuple of fixed shapes and dtypes: a linear layer's state with its conv window,
    a sliding-window layer's rings (each slot holds one layer's state exactly)."""

    def take(self, fields: tuple[Field, ...], device: torch.device) -> Slot:
        """A free slot of ``fields`` on ``device``; its contents are undefined (the caller fills them:
        a load from a lower tier decodes straight into it)."""
        return self.arena((device, fields), fields, device).take()

    def copy(self, *tensors: torch.Tensor, copies: "Copies | None" = None) -> Slot:
        """A slot holding copies of ``tensors`` (``Slot.views`` gives them back, in order), made at once
        or with ``copies`` when they are run."""
        slot = self.take(tuple(Field(tuple(t.shape), t.dtype) for t in tensors), tensors[0].device)
        Copies.into(copies, slot.views(), tensors)
        return slot


class Copies:
    """Copies into pool slots gathered to run as one (``run``: a single fused op for any count)."""

    def __init__(self) -> None:
        self.targets: list[torch.Tensor] = []
        self.sources: list[torch.Tensor] = []

    @staticmethod
    def into(copies: "Copies | None", targets: tuple[torch.Tensor, ...], sources: tuple[torch.Tensor, ...]) -> None:
        """Copy ``sources`` into ``targets`` now, or when ``copies`` runs."""
        if copies is None:
            for target, source in zip(targets, sources):
                target.copy_(source)
            return
        copies.targets += targets
        copies.sources += sources

    def run(self) -> None:
        if self.targets:
            torch._foreach_copy_(self.targets, self.sources)
        self.targets, self.sources = [], []
