"""Which public-pool entry memory gives up first: the least recently used (``lru``), or the one whose
rebuild work per byte held, aged by disuse, is lowest (``cost``).

``cost`` is GreedyDual: an entry's priority is the clock at its last use plus its rebuild cost per
byte; the lowest goes first and the clock rises to its priority, so an entry nobody uses ages out
whatever its cost. On a hybrid model a document's bytes grow like a + b n (fixed-size linear states,
KV per token) while its rebuild work grows like c n + d n^2, so short documents hold the most bytes
per unit of work saved (Marconi's argument for hybrid prefix caches).
"""
import heapq
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum


class Eviction(str, Enum):
    LRU = "lru"
    COST = "cost"


class LruOrder:
    """Least recently used first."""

    def __init__(self) -> None:
        self.order: OrderedDict[str, None] = OrderedDict()

    def touch(self, key: str, value_per_byte: float) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def forget(self, key: str, evicted: bool = False) -> None:
        self.order.pop(key, None)

    def victim(self, held: Callable[[str], bool]) -> str | None:
        """The next key to evict among those not ``held`` (None: all are held)."""
        return next((key for key in self.order if not held(key)), None)


class CostOrder:
    """GreedyDual over rebuild work per byte (see the module docstring)."""

    def __init__(self) -> None:
        self.priority: dict[str, float] = {}
        self.heap: list[tuple[float, str]] = []
        self.clock = 0.0

    def touch(self, key: str, value_per_byte: float) -> None:
        self.priority[key] = self.clock + value_per_byte
        heapq.heappush(self.heap, (self.priority[key], key))
        if len(self.heap) > 2 * len(self.priority) + 64:  # stale items (keys used again or gone): rebuild
            self.heap = [(priority, held) for held, priority in self.priority.items()]
            heapq.heapify(self.heap)

    def forget(self, key: str, evicted: bool = False) -> None:
        """Drop ``key``; an eviction raises the clock to its priority (what later uses start from)."""
        priority = self.priority.pop(key, None)
        if evicted and priority is not None:
            self.clock = max(self.clock, priority)

    def victim(self, held: Callable[[str], bool]) -> str | None:
        skipped, found = [], None
        while self.heap:
            priority, key = heapq.heappop(self.heap)
            if self.priority.get(key) != priority:
                continue  # a stale heap item: the key was used again or is gone
            skipped.append((priority, key))
            if not held(key):
                found = key
                break
        for item in skipped:
            heapq.heappush(self.heap, item)
        return found


def eviction_order(eviction: Eviction) -> LruOrder | CostOrder:
    return LruOrder() if eviction is Eviction.LRU else CostOrder()
