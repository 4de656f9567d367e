"""The public pool's tiers below memory: what is written there (the write policy), loading on a miss,
faults as misses, and the counters ``/metrics`` and ``/get_server_info`` report.

Reads run on the caller's thread (the engine loop); writes on one background thread, so the engine
never waits on a disk or a network. A tier that fails is marked unhealthy and skipped for
``RETRY_S`` seconds, then tried again: the server keeps serving from what it has.
"""
import logging
import math
import queue
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from ..arena import StateArenas
from ..store import Event, HoldingsListener, Load, SegmentEntry, Unheard
from .entry_file import BadEntryFile, EntryIdentity, decode_entry, encode_entry, named_entry, namespace_dir

log = logging.getLogger("hypic.cache.tiers")
RETRY_S = 5.0  # a failed tier is skipped this long before it is tried again
QUEUE_BYTES = 1 << 30  # entries waiting to be written, and loads not yet taken, at most (more are dropped)


class WritePolicy(str, Enum):
    """When a memory entry is written below (HiCache's policies): every entry when it is made; an
    entry once it is reused (``write_through_selective``); an entry when memory evicts it."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class PrefetchPolicy(str, Enum):
    """How long a request's prefill waits for its documents' loads, started when it arrived
    (HiCache's policies): not at all (what is not loaded yet is rebuilt), until all are done, or
    up to a timeout that grows with the bytes to load."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


PREFETCH_BASE_S = 0.2  # the timeout policy's wait for any load ...
PREFETCH_BYTES_PER_S = 200e6  # ... plus the bytes to load at this rate
MAX_PREFETCHES = 512  # loads started and not yet taken, at most (older ones are forgotten)


class TierConnecting(ConnectionError):
    """The tier is still making its first connection (Mooncake's client connects in the background):
    not usable yet, and not failed either."""


class BlobTier(Protocol):
    """A store of whole entry files by address."""

    name: str

    def open(self) -> None: ...  # connect / create; raises if the tier cannot be used now (TierConnecting: not yet)
    def reading(self, address: str): ...  # context manager: the bytes, or None if absent
    def contains(self, address: str) -> bool: ...
    def indexed(self, address: str) -> bool: ...  # held per a local index (no I/O); False where unknown
    def write(self, address: str, data: bytes) -> None: ...
    def remove(self, address: str) -> None: ...
    def flush(self, namespace_dir: str | None) -> int: ...  # entries of one namespace (None: all) dropped
    def describe(self) -> dict: ...
    on_removed: Callable[[str], None]  # set by the tiers above: told each address its index lets go


@dataclass
class TierCounters:
    """One tier's health and totals since start."""

    healthy: bool = True
    connecting: bool = False  # its first connection is under way (not healthy, not failed)
    error: str = ""
    failed_at: float = 0.0
    hits: int = 0
    misses: int = 0
    bad_files: int = 0  # truncated, damaged or foreign: deleted and counted as misses
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    writes: int = 0
    written_bytes: int = 0
    write_errors: int = 0

    def failed(self, err: BaseException) -> None:
        self.healthy, self.error, self.failed_at = False, f"{type(err).__name__}: {err}", time.monotonic()
        self.connecting = False

    def started_connecting(self) -> None:
        self.healthy, self.connecting, self.error = False, True, ""

    def answered(self) -> None:
        self.healthy, self.connecting, self.error = True, False, ""

    @property
    def state(self) -> str:
        """healthy, connecting (its first connection under way) or unhealthy (skipped after a failure)."""
        return "healthy" if self.healthy else "connecting" if self.connecting else "unhealthy"


def load_rate(loaded_bytes: int, load_seconds: float) -> float:
    """GB/s (1e9 bytes a second) of a tier's loads since start (read, check and decode); 0 before any."""
    return loaded_bytes / load_seconds / 1e9 if load_seconds > 0 else 0.0


@dataclass
class _Pending:
    entry: SegmentEntry
    tiers: list[BlobTier]


class StorageTiers:
    """The tiers below the public pool's memory, fastest first (disk, then Mooncake)."""

    def __init__(self, tiers: list[BlobTier], identity: EntryIdentity,
                 write_policy: WritePolicy = WritePolicy.WRITE_THROUGH,
                 prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT) -> None:
        self.tiers, self.identity = tiers, identity
        self.arenas: StateArenas | None = None  # the pool's slots that loads decode into (None: new tensors)
        self.write_policy, self.prefetch_policy = write_policy, prefetch_policy
        self.prefetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hypic-tier-prefetch")
        self.prefetches: OrderedDict[str, tuple[Future, float, int]] = OrderedDict()  # key -> (load, deadline, bytes)
        self.prefetched_bytes = 0  # expected bytes of the loads started and not yet taken
        self.prefetch_counts: Counter[str] = Counter()  # started, used, waited_out
        self.counters = {tier.name: TierCounters() for tier in tiers}
        self.lock = threading.Lock()
        self.queue: queue.Queue[_Pending | None] = queue.Queue()
        self.queued_bytes = self.dropped_writes = 0
        self.writing: dict[str, _Pending] = {}  # entries in the write queue by key (still readable from it)
        self.reused: Counter[str] = Counter()  # memory hits per key (write_through_selective)
        self.listener: HoldingsListener = Unheard()
        self.named: dict[str, tuple[str, str, int]] = {}  # address -> (key, namespace, tokens) some tier holds
        for tier in tiers:
            try:
                tier.open()
            except TierConnecting as err:
                log.info("%s tier connecting in the background (%s)", tier.name, err)
                self.counters[tier.name].started_connecting()
            except Exception as err:
                log.info("%s tier not ready (%s: %s); retried in the background", tier.name, type(err).__name__, err)
                self.counters[tier.name].failed(err)
        self.writer = threading.Thread(target=self._write_loop, name="hypic-tier-writer", daemon=True)
        self.writer.start()

    # ----- what is held where ---------------------------------------------------------------
    def listen(self, listener: HoldingsListener) -> None:
        """Tell ``listener`` of each entry a tier is seen to hold (written, found) and lets go of."""
        self.listener = listener
        for tier in self.tiers:
            tier.on_removed = lambda address, tier=tier: self._dropped(tier, address)

    def held(self) -> Iterator[tuple[str, str, str, int]]:
        """(key, namespace, tier, tokens) of every entry a tier with local files lists now, named from
        its file's header (a restarted server's disk); a shared store lists nothing (what other
        servers put there is unknown until asked)."""
        for tier in self.tiers:
            if not hasattr(tier, "head") or not self.counters[tier.name].healthy:
                continue
            for address in tier.addresses():  # type: ignore[attr-defined]
                if address.partition("/")[2][:1] in ("r", "k"):
                    continue  # a resume point's file, not a document's
                head = tier.head(address)  # type: ignore[attr-defined]
                named = named_entry(head, self.identity, address) if head is not None else None
                if named is not None:
                    with self.lock:
                        self.named[address] = named
                    yield named[0], named[1], tier.name, named[2]

    def _found(self, tier: BlobTier, address: str, entry: SegmentEntry) -> None:
        with self.lock:
            self.named[address] = (entry.key, entry.namespace, len(entry.token_ids))
        self.listener.stored(entry.key, entry.namespace, tier.name, len(entry.token_ids))

    def _dropped(self, tier: BlobTier, address: str) -> None:
        """``tier`` let go of ``address``; its name is forgotten once no tier holds it."""
        with self.lock:
            named = self.named.get(address)
        if named is None:
            return
        self.listener.removed(named[0], named[1], tier.name)
        if not any(t.indexed(address) for t in self.tiers):
            with self.lock:
                self.named.pop(address, None)

    # ----- reads ---------------------------------------------------------------------------
    def place_loads_in(self, arenas: StateArenas) -> None:
        """Decode every load's linear layers straight into slots of ``arenas`` (the public pool's: it
        then stores the entry without copying it again)."""
        self.arenas = arenas

    def load(self, key: str, token_ids: tuple[int, ...], namespace: str) -> tuple[SegmentEntry, str] | None:
        """Entry ``key`` of cache ``namespace`` from the fastest tier that holds a good copy, and that
        tier's name."""
        queued = self._queued_write(key, token_ids, namespace)
        if queued is not None:
            return queued
        address = self.identity.address(key, namespace)
        for tier in self.tiers:
            if not self.usable(tier):
                continue
            entry = self._load_from(tier, address, key, token_ids)
            if entry is not None:
                return entry, tier.name
        return None

    def _queued_write(self, key: str, token_ids: tuple[int, ...], namespace: str) -> tuple[SegmentEntry, str] | None:
        """Entry ``key`` if it waits in the write queue (memory evicted it under write_back a moment
        ago: it is still at hand), and the first tier it is on its way to."""
        with self.lock:
            pending = self.writing.get(key)
        if pending is None or pending.entry.token_ids != token_ids or pending.entry.namespace != namespace:
            return None
        counters = self.counters[pending.tiers[0].name]
        with self.lock:
            counters.hits += 1
        return pending.entry, pending.tiers[0].name

    def indexed(self, key: str, namespace: str) -> bool:
        """Whether a usable tier's local index holds entry ``key`` of cache ``namespace`` (no I/O: for
        the scheduler's estimates; Mooncake's knows what this server put or found there)."""
        address = self.identity.address(key, namespace)
        return any(tier.indexed(address) for tier in self.tiers if self.counters[tier.name].healthy)

    def tiers_holding(self, key: str, namespace: str) -> list[str]:
        """The names of the usable tiers whose local index holds entry ``key`` of ``namespace`` (no I/O)."""
        address = self.identity.address(key, namespace)
        return [tier.name for tier in self.tiers if self.counters[tier.name].healthy and tier.indexed(address)]

    def prefetch(self, key: str, token_ids: tuple[int, ...], namespace: str, expected_bytes: int) -> Load | None:
        """Start loading entry ``key`` in the background (a request that needs it just arrived); returns
        the load and until when (``time.monotonic``) the prefetch policy has the request wait for it
        (a scheduler holds the request back meanwhile, so ``take`` need not wait on its thread)."""
        if key in self.prefetches:
            future, deadline, _ = self.prefetches[key]
            return future, self._wait_until(deadline)
        if not any(self.usable(tier) for tier in self.tiers):
            return None
        deadline = time.monotonic() + PREFETCH_BASE_S + expected_bytes / PREFETCH_BYTES_PER_S
        future = self.prefetcher.submit(self.load, key, token_ids, namespace)
        self.prefetches[key] = (future, deadline, expected_bytes)
        self.prefetched_bytes += expected_bytes
        self.prefetch_counts["started"] += 1
        while len(self.prefetches) > MAX_PREFETCHES or self.prefetched_bytes > QUEUE_BYTES:
            self.prefetched_bytes -= self.prefetches.popitem(last=False)[1][2]  # a cancelled request's, say
        return future, self._wait_until(deadline)

    def _wait_until(self, deadline: float) -> float:
        return {PrefetchPolicy.BEST_EFFORT: 0.0, PrefetchPolicy.WAIT_COMPLETE: math.inf,
                PrefetchPolicy.TIMEOUT: deadline}[self.prefetch_policy]

    def take(self, key: str, token_ids: tuple[int, ...], namespace: str) -> tuple[SegmentEntry, str] | None:
        """``load``, through the prefetch started for ``key`` if there is one, waiting for it as the
        prefetch policy says (a load not waited for is a miss: the caller rebuilds the document)."""
        started = self.prefetches.pop(key, None)
        if started is None:
            return self.load(key, token_ids, namespace)
        future, deadline, expected_bytes = started
        self.prefetched_bytes -= expected_bytes
        until = self._wait_until(deadline)
        wait = None if until == math.inf else max(0.0, until - time.monotonic())
        try:
            found = future.result(timeout=wait)
        except FutureTimeout:
            self.prefetch_counts["waited_out"] += 1
            return None
        self.prefetch_counts["used"] += 1
        return found if found is not None and found[0].token_ids == token_ids else None

    def _load_from(self, tier: BlobTier, address: str, key: str, token_ids: tuple[int, ...]) -> SegmentEntry | None:
        counters, start = self.counters[tier.name], time.perf_counter()
        try:
            with tier.reading(address) as buffer:
                entry = None if buffer is None else decode_entry(buffer, self.identity, key, token_ids, self.arenas)
                size = 0 if buffer is None else len(buffer)
        except BadEntryFile as err:
            log.warning("%s tier: entry %s unusable (%s); deleted, recomputing", tier.name, address[:12], err)
            self._count(tier, "bad_files")
            self._remove(tier, address)
            entry = None
        except Exception as err:  # an I/O or connection failure: the tier is down, not the entry bad
            self.fail(tier, err)
            return None
        with self.lock:
            if entry is None:
                counters.misses += 1
                return None
            counters.answered()
            counters.hits += 1
            counters.loaded_bytes += size
            counters.load_seconds += time.perf_counter() - start
        self._found(tier, address, entry)
        return entry

    def usable(self, tier: BlobTier) -> bool:
        """Healthy, connected since it was last asked, or failed over ``RETRY_S`` ago and open again now
        (a master back, a disk freed)."""
        counters = self.counters[tier.name]
        if counters.healthy:
            return True
        if time.monotonic() - counters.failed_at < RETRY_S:  # never true while connecting: it has not failed
            return False
        try:
            tier.open()
        except TierConnecting:
            return False  # not failed: its first attempt is still under way
        except Exception as err:
            self.fail(tier, err)
            return False
        log.info("%s tier %s", tier.name, "connected" if counters.connecting else "available again")
        with self.lock:
            counters.answered()
        return True

    def ready(self) -> bool:
        """Whether every tier answers now (Mooncake connects in the background after a start)."""
        return all(self.usable(tier) for tier in self.tiers)

    def _remove(self, tier: BlobTier, address: str) -> None:
        try:
            tier.remove(address)
        except Exception as err:
            self.fail(tier, err)

    def fail(self, tier: BlobTier, err: BaseException) -> None:
        log.warning("%s tier unavailable (%s: %s); serving without it", tier.name, type(err).__name__, err)
        with self.lock:
            self.counters[tier.name].failed(err)

    def _count(self, tier: BlobTier, name: str, amount: int = 1) -> None:
        with self.lock:
            setattr(self.counters[tier.name], name, getattr(self.counters[tier.name], name) + amount)

    # ----- writes --------------------------------------------------------------------------
    def offer(self, entry: SegmentEntry, event: Event, origin: str = "") -> None:
        """Tell the tiers what happened to ``entry`` in memory; the write policy decides whether it is
        written (in the background) to every tier but ``origin`` (where it was just loaded from)."""
        if not self.writer.is_alive() or not self._wanted(entry, event):
            return
        tiers = [tier for tier in self.tiers if tier.name != origin]
        with self.lock:
            if self.queued_bytes + entry.nbytes > QUEUE_BYTES:
                self.dropped_writes += 1
                return
            self.queued_bytes += entry.nbytes
            pending = _Pending(entry, tiers)
            if tiers:
                self.writing[entry.key] = pending
        self.queue.put(pending)

    def _wanted(self, entry: SegmentEntry, event: Event) -> bool:
        if event is Event.EVICTED or event is Event.CLOSING:  # leaving memory: write_back's moment
            self.reused.pop(entry.key, None)
            return self.write_policy is WritePolicy.WRITE_BACK
        if self.write_policy is WritePolicy.WRITE_THROUGH:
            return event is Event.MADE
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE and event is Event.HIT:
            self.reused[entry.key] += 1
            return self.reused[entry.key] == 1  # written at its first reuse
        return False

    def _write_loop(self) -> None:
        while True:
            try:
                pending = self.queue.get(timeout=RETRY_S)
            except queue.Empty:
                self._probe()  # health is reported, and a failed tier reconnected, without traffic
                continue
            if pending is None:
                break
            try:
                self._write(pending)
            finally:
                with self.lock:
                    self.queued_bytes -= pending.entry.nbytes
                    if self.writing.get(pending.entry.key) is pending:
                        del self.writing[pending.entry.key]
                self.queue.task_done()
        self.queue.task_done()

    def _probe(self) -> None:
        for tier in self.tiers:
            if self.usable(tier):
                try:
                    tier.contains("probe/health")
                except Exception as err:
                    self.fail(tier, err)

    def _write(self, pending: _Pending) -> None:
        address, data = self.identity.address(pending.entry.key, pending.entry.namespace), None
        for tier in pending.tiers:
            if not self.usable(tier):
                continue
            try:
                if tier.contains(address):
                    self._found(tier, address, pending.entry)
                    continue
                data = data if data is not None else encode_entry(pending.entry, self.identity)
                tier.write(address, data)
            except Exception as err:
                self._count(tier, "write_errors")
                self.fail(tier, err)
                continue
            with self.lock:
                counters = self.counters[tier.name]
                counters.writes, counters.written_bytes = counters.writes + 1, counters.written_bytes + len(data)
                counters.answered()
            if tier.indexed(address):  # not when over its budget, or at once evicted again
                self._found(tier, address, pending.entry)

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.queue.unfinished_tasks and self.writer.is_alive():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes (up to ``timeout_s``) and stop the writer (once; later offers are ignored)."""
        if not self.writer.is_alive():
            return
        self.drain(timeout_s)
        self.queue.put(None)
        self.writer.join(timeout=timeout_s)
        self.prefetcher.shutdown(wait=False, cancel_futures=True)

    # ----- flush and reports ---------------------------------------------------------------
    def flush(self, names: set[str], namespace: str | None = None) -> dict[str, int]:
        """Delete the entries of the tiers named in ``names`` (of cache ``namespace`` only, if given);
        returns how many each tier dropped (a shared store may keep entries another server just read)."""
        chosen = [t for t in self.tiers if t.name in names]
        if not chosen:
            return {}
        self.drain(30.0)
        dropped = {}
        for tier in chosen:
            try:
                dropped[tier.name] = tier.flush(None if namespace is None else namespace_dir(namespace))
            except Exception as err:
                self.fail(tier, err)
                dropped[tier.name] = 0
        return dropped

    def describe(self) -> dict:
        """Each tier's configuration, health and counters, the write policy and the write queue."""
        with self.lock:
            counters = {name: dict(vars(c)) for name, c in self.counters.items()}
            queued, dropped = self.queued_bytes, self.dropped_writes
        tiers = {}
        for tier in self.tiers:
            status = {**counters[tier.name], "state": self.counters[tier.name].state}
            status["load_gb_per_s"] = load_rate(status["loaded_bytes"], status["load_seconds"])
            status.pop("failed_at")
            try:
                tiers[tier.name] = {**tier.describe(), **status}
            except Exception as err:
                tiers[tier.name] = {**status, "healthy": False, "error": f"{type(err).__name__}: {err}"}
        return {"write_policy": self.write_policy.value, "prefetch_policy": self.prefetch_policy.value,
                "prefetches": {name: self.prefetch_counts[name] for name in ("started", "used", "waited_out")},
                "write_queue": self.queue.unfinished_tasks,
                "write_queue_bytes": queued, "dropped_writes": dropped, "tiers": tiers}
