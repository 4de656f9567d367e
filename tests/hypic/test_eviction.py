"""The public pool's eviction orders against closed-form expectations: LRU order, GreedyDual's
priorities (clock + rebuild work per byte), pins never evicted, budgets never exceeded."""
import random

import pytest
import torch

from hypic.cache.eviction import Eviction
from hypic.cache.segments import Seams
from hypic.cache.store import AttentionInterior, SegmentEntry, SegmentStore


def entry(name: str, tokens: int, nbytes: int) -> SegmentEntry:
    values = torch.zeros(nbytes // 4, dtype=torch.float32)
    return SegmentEntry(name, tuple(range(tokens)), Seams(1, 1), 1, tokens - 2,
                        [AttentionInterior(values[None, :, None], torch.zeros(1, 0, 1))])


def store(eviction: Eviction, budget: int) -> SegmentStore:
    pool = SegmentStore(budget, eviction=eviction)
    pool.rebuild_cost = lambda e: float(len(e.token_ids)) ** 2  # work ~ n^2: long documents are worth more per byte
    return pool


def test_lru_evicts_the_least_recently_used() -> None:
    pool = store(Eviction.LRU, 300)
    for name in "abc":
        pool.put(entry(name, 10, 100))
    pool.get("a", tuple(range(10)))
    pool.put(entry("d", 10, 100))
    assert set(pool.entries) == {"a", "c", "d"}


def test_cost_keeps_the_work_per_byte_and_ages_what_is_unused() -> None:
    """Priorities: short (n=10, 100 B): 100/100 = 1; long (n=100, 100 B): 10000/100 = 100."""
    pool = store(Eviction.COST, 300)
    pool.put(entry("long", 100, 100))
    pool.put(entry("short1", 10, 100))
    pool.put(entry("short2", 10, 100))
    pool.put(entry("short3", 10, 100))  # a short one goes although the long one is older
    assert "long" in pool.entries and pool.evictions == 1
    assert pool.order.clock == pytest.approx(1.0)  # the clock rose to the evicted priority
    for round_ in range(250):  # shorts used over and over: the clock climbs ~0.5 a round, past 100 at last
        name = f"s{round_}"
        pool.put(entry(name, 10, 100))
        pool.get(name, tuple(range(10)))
        if round_ == 150:
            assert "long" in pool.entries  # ... but not yet at 150 rounds (clock ~ 76)
    assert "long" not in pool.entries


@pytest.mark.parametrize("eviction", list(Eviction))
def test_pinned_entries_stay_and_the_budget_holds(eviction: Eviction) -> None:
    rng = random.Random(0)
    pool = store(eviction, 1000)
    pinned = entry("pinned", 50, 400)
    pool.put(pinned)
    pool.pin("pinned")
    for index in range(200):
        size = rng.choice([100, 200, 300])
        kept = pool.put(entry(f"e{index}", rng.randint(5, 80), size))
        assert pool.nbytes <= 1000 and "pinned" in pool.entries
        assert pool.nbytes == sum(e.nbytes for e in pool.entries.values())
        assert pool.pinned_bytes == 400 and kept  # 600 unpinned bytes always make room for 300
    assert not pool.put(entry("too-big", 10, 700))  # over what the pins leave: refused, nothing evicted
    pool.unpin("pinned")
    assert pool.pinned_bytes == 0 and pool.put(entry("big", 10, 700))


def test_cost_order_stays_bounded_and_picks_greedydual_victims_under_many_hits() -> None:
    """Hits push a new heap item each; the stale ones must not pile up. Victims match GreedyDual
    worked out directly: the lowest (clock at last use + value per byte) among keys not held."""
    from hypic.cache.eviction import CostOrder
    rng, order = random.Random(0), CostOrder()
    priority, clock = {}, 0.0
    for step in range(20_000):
        key = f"k{rng.randrange(8)}"
        value = rng.choice([1.0, 2.5, 7.0])
        order.touch(key, value)
        priority[key] = clock + value
        if step % 97 == 0:
            held = {f"k{rng.randrange(8)}"}
            expected = min((p, k) for k, p in priority.items() if k not in held)[1]
            assert order.victim(lambda k: k in held) == expected
            order.forget(expected, evicted=True)
            clock = max(clock, priority.pop(expected))
    assert len(order.heap) <= 2 * len(order.priority) + 64 + 1
