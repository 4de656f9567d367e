"""Checks on a segment entry that crossed a process boundary, before the receiver splices it."""
from collections.abc import Callable
from dataclasses import dataclass

from hypic.config import ModelConfig
from hypic.engine import Engine
from hypic.cache.entry_check import EntryMismatch as TransferError  # the router's name for it
from hypic.cache.entry_check import check_entry
from hypic.cache.modes import Mode
from hypic.cache.store import Role, SegmentEntry
from hypic.models.families import linear_shapes

from .channel import BulkChannel, ChannelError, Parcel


def entries_of(batches: list[list[SegmentEntry]]) -> list[SegmentEntry]:
    """The entries of several shipments (each one peer's list), in order."""
    return [entry for batch in batches for entry in batch]


def install_entries(engine: Engine, entries: list[SegmentEntry], mode: Mode) -> tuple[list[str], int]:
    """Check and store received entries in ``engine``'s public pool; returns the keys kept and how
    many were refused (dropped: the combine pass recomputes them)."""
    passed = checked(engine, entries, mode)
    return [entry.key for entry in passed if engine.cache.install_document(entry)], len(entries) - len(passed)


def lend_entries(engine: Engine, entries: list[SegmentEntry], mode: Mode) -> list[str]:
    """Check received copies of entries another pool holds and lend them to a request here (kept
    only if they fit beside what is held); returns the keys lent (to be returned once the request is
    done with them). A refused one is left out: the combine pass recomputes it."""
    return [entry.key for entry in checked(engine, entries, mode) if not engine.cache.lend_document(entry)]


def keep_copies(engine: Engine, entries: list[SegmentEntry], mode: Mode) -> list[str]:
    """Check copies of entries another pool holds, made ahead of need, and keep each that fits
    beside what ``engine``'s public pool holds (evicting nothing); returns the keys kept."""
    return [entry.key for entry in checked(engine, entries, mode) if engine.cache.keep_copy(entry)]


def checked(engine: Engine, entries: list[SegmentEntry], mode: Mode) -> list[SegmentEntry]:
    """The received ``entries`` that pass ``check_entry`` against ``engine``'s model and ``mode``'s role."""
    check, passed = entry_check(engine.fingerprint, engine.policy(mode).role, engine.model.config), []
    for entry in entries:
        try:
            check(entry)
        except TransferError:
            continue
        passed.append(entry)
    return passed


def entry_check(fingerprint: str, role: Role, config: ModelConfig) -> Callable[[SegmentEntry], None]:
    """``check_entry`` against one model and role."""
    linear = linear_shapes(config)
    return lambda entry: check_entry(entry, fingerprint, role, config, linear)


@dataclass
class ReceiveCounts:
    """Entries a combine node received, by path, and parcels that did not arrive or were refused."""

    point_to_point: int = 0
    object_store: int = 0
    failed: int = 0

    def add(self, other: "ReceiveCounts") -> None:
        self.point_to_point += other.point_to_point
        self.object_store += other.object_store
        self.failed += other.failed


def receive_all(channel: BulkChannel | None, items: list[SegmentEntry | Parcel],
                check: Callable[[SegmentEntry], None]) -> tuple[list[SegmentEntry], ReceiveCounts]:
    """Entries as they are (they came through the object store), parcels received over ``channel``
    (their headers ``check``-ed first); returns the entries and the counts."""
    entries, counts = [], ReceiveCounts()
    for item in items:
        if not isinstance(item, Parcel):
            entries.append(item)
            counts.object_store += 1
            continue
        try:
            if channel is None:
                raise ChannelError("a parcel arrived but this process has no bulk-transfer group")
            entries.append(channel.receive(item, check))
            counts.point_to_point += 1
        except (ChannelError, TransferError):
            counts.failed += 1
    return entries, counts
