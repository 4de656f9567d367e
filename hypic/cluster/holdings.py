"""Where a replica holds its documents, as one ordered stream of events per replica.

The replica's pools and tiers tell ``HoldingsLog`` each entry they store and drop as it happens (no
diff of everything held); the log numbers the changes, keeps the last ``LOG_EVENTS`` of them and
what is held now. A follower (an ingress) reads the stream from where it left off: the missing
range is replayed from the log, and only a follower the log cannot serve (new, or too far behind,
or from another incarnation of the replica) is sent a full dump first. The events are those a KV
indexer consumes: stored / evicted / cleared, each with its tier.
"""
import asyncio
import contextlib
import itertools
import logging
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from ..cache.hybrid_cache import HybridCache
from ..cache.store import MEMORY_TIER
from .index import Announcement, HoldingEvent, Tier

log = logging.getLogger("hypic.cluster")
LOG_EVENTS = 1 << 16  # events kept for followers that fall behind (a longer gap costs a dump)
BATCH_EVENTS = 4096  # events per message at most
KEEPALIVE_S = 2.0  # a follower hears from an idle replica this often (its deadline on silence)
TIER_OF = {MEMORY_TIER: Tier.MEMORY, "host": Tier.HOST, "disk": Tier.DISK, "mooncake": Tier.SHARED}


@dataclass(frozen=True)
class HoldingsMark:
    """How far a replica's holdings stream had come when it sent an answer: the ingress lets the
    answer out once its index has applied that far (the client's next request then routes by it)."""

    replica: str
    incarnation: str
    seq: int


@dataclass
class _Held:
    namespace: str
    tokens: int
    tiers: set[Tier] = field(default_factory=set)


class HoldingsLog:
    """A replica's holdings: the listener its cache tells of each store and drop (from any thread),
    the numbered log of those changes, and the followers' streams of them. ``fill`` says how full the
    public pool is (sent with each message)."""

    def __init__(self, replica: str, fill: Callable[[], float], capacity: int = LOG_EVENTS) -> None:
        self.replica, self.fill = replica, fill
        self.incarnation = uuid.uuid4().hex  # a restarted replica starts a new numbering
        self.seq = 0  # the number of the last event (the first is 1)
        self.log: deque[HoldingEvent] = deque(maxlen=capacity)
        self.held: dict[str, _Held] = {}
        self.lock = threading.Lock()
        self.waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    # ----- what the cache tells ------------------------------------------------------------------
    def stored(self, key: str, namespace: str, tier: str, tokens: int) -> None:
        level = TIER_OF.get(tier)
        if level is None:
            return
        with self.lock:
            held = self.held.setdefault(key, _Held(namespace, tokens))
            if level not in held.tiers:  # a tier that finds again what it holds tells nothing new
                held.tiers.add(level)
                self._append(HoldingEvent("stored", key, namespace, level, tokens))

    def removed(self, key: str, namespace: str, tier: str) -> None:
        level = TIER_OF.get(tier)
        with self.lock:
            held = self.held.get(key)
            if held is None or level not in held.tiers:
                return
            held.tiers.discard(level)
            if not held.tiers:
                del self.held[key]
            self._append(HoldingEvent("evicted", key, namespace, level))  # type: ignore[arg-type]

    def cleared(self, namespace: str | None) -> None:
        """A flush emptied memory (of ``namespace``; None: all): followers forget the replica's
        prompt prefixes there, and are told again what it still holds there (below memory, in use)."""
        with self.lock:
            self._append(HoldingEvent("cleared", "", namespace))
            for key, held in self.held.items():
                if namespace is None or held.namespace == namespace:
                    for tier in sorted(held.tiers):
                        self._append(HoldingEvent("stored", key, held.namespace, tier, held.tokens))

    def scan(self, found: Iterable[tuple[str, str, str, int]]) -> None:
        """Take in what the tiers below memory held at start (a restarted server's disk), as found."""
        count = 0
        for key, namespace, tier, tokens in found:
            self.stored(key, namespace, tier, tokens)
            count += 1
        if count:
            log.info("replica %s: %d documents found in the tiers below memory at start", self.replica, count)

    def _append(self, event: HoldingEvent) -> None:
        """Number ``event`` and wake the followers (call with the lock held)."""
        self.seq += 1
        self.log.append(event)
        for waiter in list(self.waiters):
            loop, wake = waiter
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # its event loop closed: a follower that will not come back
                self.waiters.discard(waiter)

    # ----- what followers read ----------------------------------------------------------------------
    def since(self, after: tuple[str, int] | None) -> Announcement:
        """What a follower that has applied up to ``after`` (incarnation, seq) needs next: the events
        after it (at most ``BATCH_EVENTS``), or a dump of everything held when the log does not reach
        back that far (None: a new follower)."""
        with self.lock:
            oldest = self.seq - len(self.log)  # the last event no longer in the log
            if after is None or after[0] != self.incarnation or not oldest <= after[1] <= self.seq:
                return self._dump()
            behind = self.seq - after[1]
            news = list(itertools.islice(reversed(self.log), behind))[::-1][:BATCH_EVENTS]
            return Announcement(self.replica, self.incarnation, after[1] + len(news), tuple(news),
                                pool_fill=self.fill())

    def _dump(self) -> Announcement:
        events = tuple(HoldingEvent("stored", key, held.namespace, tier, held.tokens)
                       for key, held in self.held.items() for tier in sorted(held.tiers))
        return Announcement(self.replica, self.incarnation, self.seq, events, full=True, pool_fill=self.fill())

    def mark(self) -> HoldingsMark:
        with self.lock:
            return HoldingsMark(self.replica, self.incarnation, self.seq)

    async def follow(self, after: tuple[str, int] | None, keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[Announcement]:
        """The stream from ``after`` on: each message as soon as there is news, an empty one after
        ``keepalive_s`` without any (the follower's deadline on silence)."""
        wake = asyncio.Event()
        waiter = (asyncio.get_running_loop(), wake)
        with self.lock:
            self.waiters.add(waiter)
        try:
            while True:
                wake.clear()  # before the read: news appended after it wakes the next wait
                told = self.since(after)
                yield told
                after = (told.incarnation, told.seq)
                if told.seq < self.seq:
                    continue  # more than one message's worth behind
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), keepalive_s)
        finally:
            with self.lock:
                self.waiters.discard(waiter)


def holdings_of(cache: HybridCache, replica: str) -> HoldingsLog:
    """A holdings log that ``cache`` tells of every store and drop from now on, started with what
    memory holds and, in the background, what the tiers below list (a restarted server's disk)."""
    holdings = HoldingsLog(replica, cache.public_fill)
    cache.listen(holdings)
    for entry in cache.held_documents(sorted(cache.document_keys())):
        holdings.stored(entry.key, entry.namespace, MEMORY_TIER, len(entry.token_ids))
    threading.Thread(target=holdings.scan, args=(cache.held_below(),), name="hypic-holdings-scan", daemon=True).start()
    return holdings


__all__ = ["HoldingsLog", "HoldingsMark", "KEEPALIVE_S", "holdings_of"]
