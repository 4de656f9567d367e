"""Which replica holds which document entry, and in which tier, as the replicas announce it.

Each replica pushes numbered batches of holding events (an entry stored in or evicted from a tier, a
namespace or everything cleared). The index applies a batch only if it follows the last one it has
from that replica (same process incarnation, no gap in the numbering); otherwise the caller asks the
replica for a dump of all it holds, which replaces what the index knew of it (unless it is older
than what the index has of that incarnation). A namespace left without entries is forgotten. The index also keeps
the prompt prefixes each replica served (its private pool), as ``hypic.router``'s ``PrefixIndex``,
and per namespace how many of its entries each replica holds in memory (where a tenant lives).

Memory: a document's entry is one row of an open-addressing table held in numpy arrays (its key's
64-bit hash, its namespace's id and one bit per (tier, replica)), about 44 bytes a row, not Python
objects per key. Two keys whose 64-bit hashes collide share a row: the router may then believe a
replica holds an entry it does not, which costs that replica a recompute, never a wrong answer
(a replica matches its own pool by the full key).
"""
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from hypic.router.prefix_index import PrefixIndex

KINDS = ("stored", "evicted", "cleared")
WORD = 64  # replica slots per bit word
MASK64 = (1 << 64) - 1
EMPTY, REMOVED = 0, 1  # key-hash values that mark a free row and a row whose key was removed
MAX_FILL = 0.75  # the table grows (or is rebuilt without removed rows) past this fill


class Tier(IntEnum):
    """Where a replica holds a document's entry; lower is cheaper to load."""

    MEMORY = 0
    HOST = 1
    DISK = 2
    SHARED = 3  # a store every replica loads from (Mooncake): one replica's report stands for them all


TIERS = tuple(Tier)


@dataclass(frozen=True, slots=True)
class HoldingEvent:
    """One change in what a replica holds. ``kind``: "stored" | "evicted" | "cleared"; ``key``: the
    entry's key (unique across namespaces); ``namespace``: the entry's namespace (stored), or the one
    emptied (cleared; None: every namespace); ``tier``: which tier gained or lost it; ``tokens``: its
    document's length (stored)."""

    kind: str
    key: str = ""
    namespace: str | None = ""
    tier: Tier = Tier.MEMORY
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Announcement:
    """What one replica pushes: its events numbered ``seq - len(events) + 1`` .. ``seq`` (a replica's
    first event is 1) under its process ``incarnation``; ``full``: a dump whose events ("stored") are
    all it holds, replacing what the index knew of it."""

    replica: str
    incarnation: str
    seq: int
    events: tuple[HoldingEvent, ...] = ()
    full: bool = False
    pool_fill: float | None = None  # its public pool's bytes over its budget as it announced (None: not said)


def key_hash(key: str) -> int:
    """The table's 64-bit name of an entry key (never EMPTY or REMOVED)."""
    h = hash(key) & MASK64
    return h if h > REMOVED else h + 2


class _KeyTable:
    """Linear-probing hash table of entry keys: per row the key's hash, its namespace id, and per tier a
    bit word per 64 replica slots."""

    def __init__(self, capacity: int = 1024, words: int = 1) -> None:
        self._reset(capacity, words)

    def _reset(self, capacity: int, words: int) -> None:
        self.keys = np.zeros(capacity, np.uint64)
        self.namespaces = np.zeros(capacity, np.uint32)
        self.bits = np.zeros((capacity, len(TIERS), words), np.uint64)
        self.mask, self.live, self.filled = capacity - 1, 0, 0  # filled: live and removed rows

    @property
    def words(self) -> int:
        return self.bits.shape[2]

    def find(self, h: int) -> int:
        """The row of hash ``h``, or -1."""
        keys, mask, row = self.keys, self.mask, h & self.mask
        while True:
            found = keys.item(row)
            if found == h:
                return row
            if found == EMPTY:
                return -1
            row = (row + 1) & mask

    def insert(self, h: int, namespace: int) -> int:
        """The row of hash ``h``, added (with no bits, in ``namespace``) if absent."""
        row = self.find(h)
        if row >= 0:
            return row
        if self.filled + 1 > MAX_FILL * len(self.keys):
            self._rebuild(self.live + 1)
        keys, mask, row = self.keys, self.mask, h & self.mask
        while keys.item(row) > REMOVED:
            row = (row + 1) & mask
        self.filled += keys.item(row) == EMPTY
        self.live += 1
        keys[row], self.namespaces[row] = h, namespace
        return row

    def drop_if_empty(self, row: int) -> bool:
        """Remove ``row`` if no replica holds it any more; whether it was removed."""
        if self.bits[row].any():
            return False
        self.keys[row], self.live = REMOVED, self.live - 1
        return True

    def drop_empty_rows(self) -> np.ndarray:
        """Every row left without bits (after a bulk clear) is removed; their namespace ids."""
        empty = (self.keys > REMOVED) & ~self.bits.any(axis=(1, 2))
        self.keys[empty] = REMOVED
        self.live -= int(empty.sum())
        return self.namespaces[empty]

    def widen(self, words: int) -> None:
        extra = np.zeros((len(self.keys), len(TIERS), words - self.words), np.uint64)
        self.bits = np.concatenate([self.bits, extra], axis=2)

    def _rebuild(self, live: int) -> None:
        """Rows re-placed into a table at most half full with ``live`` keys (removed rows gone), all at
        once: each round every unplaced key steps past an occupied row or takes a free one (the first
        claimant of each free row wins it)."""
        capacity = 1024
        while capacity < 2 * live:
            capacity *= 2
        kept = self.keys > REMOVED
        hashes, namespaces, bits = self.keys[kept], self.namespaces[kept], self.bits[kept]
        self._reset(capacity, self.words)
        row = (hashes & np.uint64(self.mask)).astype(np.int64)
        pending = np.arange(len(hashes))
        while len(pending):
            taken = self.keys[row[pending]] != EMPTY
            row[pending[taken]] = (row[pending[taken]] + 1) & self.mask
            free = pending[~taken]
            rows, first = np.unique(row[free], return_index=True)
            winners = free[first]
            self.keys[rows], self.namespaces[rows], self.bits[rows] = hashes[winners], namespaces[winners], bits[winners]
            pending = np.setdiff1d(pending, winners, assume_unique=True)
        self.live = self.filled = len(hashes)


@dataclass
class _Heard:
    """The last announcement applied from a replica."""

    incarnation: str
    seq: int


class DocumentIndex:
    """Replica -> the document entries it holds and where, from its announcements; and the prompt
    prefixes it served."""

    def __init__(self, prefixes: PrefixIndex | None = None) -> None:
        self._table = _KeyTable()
        self._slots: dict[str, int] = {}  # replica -> its bit in the table's words
        self._replica_of: dict[int, str] = {}
        self._namespace_ids: dict[str, int] = {}
        self._namespace_names: list[str | None] = []  # by id (None: a forgotten namespace's id, free)
        self._namespace_rows: dict[int, int] = {}  # namespace id -> rows of the table in it (0: forgotten)
        self._namespace_held: dict[int, dict[int, int]] = {}  # namespace id -> replica slot -> entries in its memory
        self._free_namespaces: list[int] = []
        self._pending: dict[tuple[str, str], dict[str, int]] = {}  # (namespace, key) -> replica -> calls building it
        self._heard: dict[str, _Heard] = {}
        self.prefixes = prefixes or PrefixIndex()

    # ----- announcements ------------------------------------------------------------------------
    def apply(self, announcement: Announcement) -> bool:
        """Apply ``announcement``. False: it does not follow what the index has of its replica (a new
        incarnation, a gap in the numbering, a replica not heard from): ask that replica for a dump.
        A dump is applied unless it is older than what is known of the same incarnation; a batch
        entirely older than what is known is ignored (True)."""
        if announcement.full:
            heard = self._heard.get(announcement.replica)
            if heard is None or heard.incarnation != announcement.incarnation or announcement.seq >= heard.seq:
                self._apply_dump(announcement)
            return True
        heard = self._heard.get(announcement.replica)
        first = announcement.seq - len(announcement.events) + 1
        if heard is None or heard.incarnation != announcement.incarnation or first > heard.seq + 1:
            return False
        fresh = announcement.events[max(0, heard.seq + 1 - first):]
        self._apply_events(announcement.replica, fresh)
        heard.seq = max(heard.seq, announcement.seq)
        return True

    def _apply_dump(self, dump: Announcement) -> None:
        if any(event.kind != "stored" for event in dump.events):
            raise ValueError(f"a dump from replica {dump.replica} holds events other than stored")
        self._clear(dump.replica, None)
        self._apply_events(dump.replica, dump.events)
        self._heard[dump.replica] = _Heard(dump.incarnation, dump.seq)

    def _apply_events(self, replica: str, events: Iterable[HoldingEvent]) -> None:
        for event in events:
            if event.kind == "stored":
                self._store(replica, event)
            elif event.kind == "evicted":
                self._evict(replica, event)
            elif event.kind == "cleared":  # a flush: its private pool's prefixes went too
                self._clear(replica, event.namespace)
                self.prefixes.forget_worker(replica)
            else:
                raise ValueError(f"unknown holding event kind {event.kind} from replica {replica}: "
                                 f"expected one of {', '.join(KINDS)}")

    def _store(self, replica: str, event: HoldingEvent) -> None:
        slot = self._slot(replica)
        table = self._table
        h = key_hash(event.key)
        row = table.find(h)
        if row < 0:
            namespace = self._namespace_id(event.namespace or "")
            row = table.insert(h, namespace)
            self._namespace_rows[namespace] = self._namespace_rows.get(namespace, 0) + 1
        word, bit = divmod(slot, WORD)
        tier = int(event.tier)
        before = table.bits.item(row, tier, word)
        table.bits[row, tier, word] = before | (1 << bit)
        if tier == Tier.MEMORY and not before >> bit & 1:
            self._count(table.namespaces.item(row), slot, 1)

    def _evict(self, replica: str, event: HoldingEvent) -> None:
        slot, table = self._slots.get(replica), self._table
        row = table.find(key_hash(event.key))
        if slot is None or row < 0:
            return
        word, bit = divmod(slot, WORD)
        tier = int(event.tier)
        before = table.bits.item(row, tier, word)
        table.bits[row, tier, word] = before & ~(1 << bit) & MASK64
        if tier == Tier.MEMORY and before >> bit & 1:
            self._count(table.namespaces.item(row), slot, -1)
        if table.drop_if_empty(row):
            self._rows_dropped([table.namespaces.item(row)])

    def _count(self, namespace: int, slot: int, change: int) -> None:
        """``slot``'s count of entries of ``namespace`` in memory changes by ``change``."""
        held = self._namespace_held.setdefault(namespace, {})
        count = held.get(slot, 0) + change
        if count:
            held[slot] = count
        else:
            del held[slot]
            if not held:
                del self._namespace_held[namespace]

    def _clear(self, replica: str, namespace: str | None) -> None:
        """``replica`` holds nothing (in ``namespace``, or in any namespace when None)."""
        slot, table = self._slots.get(replica), self._table
        if slot is None or (namespace is not None and namespace not in self._namespace_ids):
            return
        word, bit = divmod(slot, WORD)
        keep = np.uint64(~(1 << bit) & MASK64)
        if namespace is None:
            table.bits[:, :, word] &= keep
        else:
            rows = table.namespaces == self._namespace_ids[namespace]
            table.bits[rows, :, word] &= keep
        self._recount(slot)
        self._rows_dropped(table.drop_empty_rows().tolist())

    def _rows_dropped(self, namespaces: list[int]) -> None:
        """Rows of ``namespaces`` (ids, one per row) left the table; a namespace left without rows
        is forgotten (its id reused): client-named namespaces come and go."""
        for found in namespaces:
            rows = self._namespace_rows[found] - 1
            if rows:
                self._namespace_rows[found] = rows
                continue
            del self._namespace_rows[found]
            name = self._namespace_names[found]
            self._namespace_ids.pop(name, None)  # type: ignore[arg-type]
            self._namespace_names[found] = None
            self._namespace_held.pop(found, None)
            self._free_namespaces.append(found)

    def _recount(self, slot: int) -> None:
        """``slot``'s entries in memory per namespace, counted afresh from the table (after a bulk clear)."""
        word, bit = divmod(slot, WORD)
        table = self._table
        held = (table.keys > REMOVED) & ((table.bits[:, Tier.MEMORY, word] & np.uint64(1 << bit)) != 0)
        counts = np.bincount(table.namespaces[held], minlength=len(self._namespace_names))
        for namespace, held_by in list(self._namespace_held.items()):
            held_by.pop(slot, None)
            if not held_by:
                del self._namespace_held[namespace]
        for namespace in np.flatnonzero(counts).tolist():
            self._namespace_held.setdefault(namespace, {})[slot] = int(counts[namespace])

    # ----- queries ------------------------------------------------------------------------------
    def holders(self, namespace: str, key: str) -> dict[str, Tier]:
        """Replica -> the cheapest tier it holds the entry of ``key`` (in ``namespace``) in; a replica
        a request was sent to that will store it (``pend``) counts as holding it in memory."""
        out = self.held_by(namespace, key)
        for replica in self._pending.get((namespace, key), ()):
            out.setdefault(replica, Tier.MEMORY)
        return out

    def held_by(self, namespace: str, key: str) -> dict[str, Tier]:
        """``holders`` as the replicas' holdings say, documents on their way left out."""
        table = self._table
        row = table.find(key_hash(key))
        if row < 0 or self._namespace_names[table.namespaces.item(row)] != namespace:
            return {}
        out: dict[str, Tier] = {}
        for tier in TIERS:
            for word in range(table.words):
                for slot in _set_bits(table.bits.item(row, tier, word)):
                    out.setdefault(self._replica_of[word * WORD + slot], tier)
        return out

    def shared(self, namespace: str, key: str) -> bool:
        """Whether any replica reports the entry of ``key`` (in ``namespace``) in the shared store."""
        table = self._table
        row = table.find(key_hash(key))
        if row < 0 or self._namespace_names[table.namespaces.item(row)] != namespace:
            return False
        return any(table.bits.item(row, Tier.SHARED, word) for word in range(table.words))

    def namespace_holders(self, namespace: str) -> dict[str, int]:
        """Replica -> how many entries of ``namespace`` it holds in memory (where the namespace is hot)."""
        found = self._namespace_ids.get(namespace)
        held = self._namespace_held.get(found, {}) if found is not None else {}
        return {self._replica_of[slot]: count for slot, count in held.items()}

    def replicas(self) -> list[str]:
        """Replicas the index has heard from (an announcement or a served prompt), by id."""
        return sorted(set(self._heard) | set(self._slots) | set(self.prefixes.workers()))

    def documents_of(self, replica: str) -> int:
        """How many entries ``replica`` holds in any tier (a scan of the table: for metrics, not per request)."""
        slot = self._slots.get(replica)
        if slot is None:
            return 0
        word, bit = divmod(slot, WORD)
        return int(((self._table.bits[:, :, word] & np.uint64(1 << bit)) != 0).any(axis=1).sum())

    def documents(self) -> int:
        """How many entries some replica holds."""
        return self._table.live

    def forget(self, replica: str) -> None:
        """``replica`` is gone: it holds nothing, its prefixes included; its next announcement is not
        applied (a dump is asked for)."""
        self._clear(replica, None)
        slot = self._slots.pop(replica, None)
        if slot is not None:
            del self._replica_of[slot]
        self._heard.pop(replica, None)
        self.prefixes.forget_worker(replica)
        for document in [d for d, calls in self._pending.items() if replica in calls]:
            self.unpend(replica, document[0], [document[1]])

    # ----- documents on their way ------------------------------------------------------------------
    def pend(self, replica: str, namespace: str, keys: Iterable[str]) -> None:
        """``replica`` was sent a request that will store ``keys``: until ``unpend``, a request for
        them counts them as there (concurrent requests for a new document go where it is being built)."""
        for key in keys:
            calls = self._pending.setdefault((namespace, key), {})
            calls[replica] = calls.get(replica, 0) + 1

    def unpend(self, replica: str, namespace: str, keys: Iterable[str]) -> None:
        """That request ended: what ``replica`` stored is known from its holdings now."""
        for key in keys:
            calls = self._pending.get((namespace, key), {})
            if calls.get(replica, 0) > 1:
                calls[replica] -= 1
                continue
            calls.pop(replica, None)
            if not calls:
                self._pending.pop((namespace, key), None)

    def pending(self) -> int:
        """How many documents are on their way to some replica (requests sent, not yet ended)."""
        return len(self._pending)

    # ----- prefixes -----------------------------------------------------------------------------
    def record_prefix(self, replica: str, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> None:
        """``replica`` served a prompt of ``token_ids``: its private pool holds its prefix."""
        self.prefixes.record(replica, token_ids, namespace)

    def prefix_matched(self, token_ids: list[int] | tuple[int, ...], namespace: str = "") -> dict[str, int]:
        """Replica -> how many leading tokens of ``token_ids`` it is believed to hold (whole blocks)."""
        return self.prefixes.matched(token_ids, namespace)

    # ----- interning ----------------------------------------------------------------------------
    def _slot(self, replica: str) -> int:
        """``replica``'s bit: the lowest free one (a forgotten replica's bit is reused, cleared)."""
        slot = self._slots.get(replica)
        if slot is None:
            slot = next(s for s in range(len(self._slots) + 1) if s not in self._replica_of)
            if slot >= self._table.words * WORD:
                self._table.widen(self._table.words + 1)
            self._slots[replica], self._replica_of[slot] = slot, replica
        return slot

    def _namespace_id(self, namespace: str) -> int:
        found = self._namespace_ids.get(namespace)
        if found is None:
            found = self._free_namespaces.pop() if self._free_namespaces else len(self._namespace_names)
            if found == len(self._namespace_names):
                self._namespace_names.append(namespace)
            self._namespace_names[found], self._namespace_ids[namespace] = namespace, found
        return found

    def namespaces(self) -> int:
        """How many namespaces some replica holds an entry of."""
        return len(self._namespace_ids)


def _set_bits(word: int) -> Iterable[int]:
    """The positions of the bits set in ``word``, lowest first."""
    while word:
        low = word & -word
        yield low.bit_length() - 1
        word ^= low


__all__ = ["Announcement", "DocumentIndex", "HoldingEvent", "Tier"]
