"""DocumentIndex against a plain model of what each replica holds: random streams of stores,
evictions, clears, restarts and deaths, announced in batches the network drops and delays."""
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypic.cluster.index import Announcement, DocumentIndex, HoldingEvent, Tier

NAMESPACES = ("", "alpha", "beta")


@dataclass
class Replica:
    """A replica as the test sees it: key -> the tiers it holds it in, and its numbered events."""

    name: str
    incarnation: int = 0
    held: dict[str, set[Tier]] = field(default_factory=dict)
    log: list[HoldingEvent] = field(default_factory=list)
    sent: int = 0  # events announced so far (delivered or not)

    def restart(self) -> None:
        self.incarnation, self.held, self.log, self.sent = self.incarnation + 1, {}, [], 0

    def batch(self) -> Announcement:
        events, self.sent = tuple(self.log[self.sent:]), len(self.log)
        return Announcement(self.name, str(self.incarnation), len(self.log), events)

    def dump(self) -> Announcement:
        events = tuple(HoldingEvent("stored", key, namespace_of(key), tier) for key, tiers in self.held.items() for tier in tiers)
        return Announcement(self.name, str(self.incarnation), len(self.log), events, full=True)


def namespace_of(key: str) -> str:
    return NAMESPACES[int(key[1:]) % len(NAMESPACES)]


def act(replica: Replica, rng: random.Random, keys: list[str]) -> None:
    """One random change to ``replica``'s holdings, logged as its replica would announce it."""
    roll, key, tier = rng.random(), rng.choice(keys), rng.choice(list(Tier))
    if roll < 0.55:
        replica.held.setdefault(key, set()).add(tier)
        replica.log.append(HoldingEvent("stored", key, namespace_of(key), tier, tokens=100))
    elif roll < 0.9:
        if tier in replica.held.get(key, ()):
            replica.held[key].discard(tier)
            if not replica.held[key]:
                del replica.held[key]
        replica.log.append(HoldingEvent("evicted", key, namespace_of(key), tier))
    else:
        namespace = rng.choice((None, *NAMESPACES))
        replica.held = {k: t for k, t in replica.held.items() if namespace is not None and namespace_of(k) != namespace}
        replica.log.append(HoldingEvent("cleared", namespace=namespace))


def deliver(index: DocumentIndex, announcement: Announcement, replicas: dict[str, Replica]) -> None:
    if not index.apply(announcement):
        assert index.apply(replicas[announcement.replica].dump())


def assert_matches(index: DocumentIndex, replicas: dict[str, Replica], keys: list[str]) -> None:
    for key in keys:
        truth = {r.name: min(r.held[key]) for r in replicas.values() if key in r.held}
        assert index.holders(namespace_of(key), key) == truth, key
    for replica in replicas.values():
        assert index.documents_of(replica.name) == len(replica.held)
    for namespace in NAMESPACES:
        truth = {r.name: sum(namespace_of(key) == namespace and Tier.MEMORY in tiers for key, tiers in r.held.items())
                 for r in replicas.values()}
        assert index.namespace_holders(namespace) == {name: count for name, count in truth.items() if count}, namespace
    assert index.documents() == len(set().union(*(r.held for r in replicas.values())))


def run_stream(seed: int, replica_count: int, key_count: int, steps: int, check_every: int = 1) -> None:
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(key_count)]
    replicas = {name: Replica(name) for name in (f"r{i}" for i in range(replica_count))}
    index, delayed = DocumentIndex(), []
    for replica in replicas.values():
        deliver(index, replica.batch(), replicas)
    for step in range(steps):
        replica = rng.choice(list(replicas.values()))
        for _ in range(rng.randint(1, 4)):
            act(replica, rng, keys)
        fate = rng.random()
        if fate < 0.6:
            deliver(index, replica.batch(), replicas)
        elif fate < 0.7:
            replica.batch()  # lost
        elif fate < 0.8:
            delayed.append(replica.batch())
        elif fate < 0.85:
            replica.restart()
        elif fate < 0.9:
            index.forget(replica.name)  # it died; a replica of the same id comes back empty
            replica.restart()
        if delayed and rng.random() < 0.3:
            deliver(index, delayed.pop(rng.randrange(len(delayed))), replicas)
        if step % check_every == 0:
            for each in replicas.values():  # a heartbeat: the latest number, no events unsent
                deliver(index, each.batch(), replicas)
            assert_matches(index, replicas, keys)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_index_equals_every_replicas_holdings_through_lost_and_late_announcements(seed: int) -> None:
    run_stream(seed, replica_count=4, key_count=12, steps=60)


def test_the_index_equals_the_holdings_of_many_replicas_over_many_keys() -> None:
    """More replicas than one bit word holds, more keys than the first table holds (it grows and is
    rebuilt without its removed rows)."""
    run_stream(seed=11, replica_count=70, key_count=3000, steps=1500, check_every=250)


def _stored(key: str, tier: Tier = Tier.MEMORY, namespace: str = "") -> HoldingEvent:
    return HoldingEvent("stored", key, namespace, tier, 10)


def test_a_replica_never_heard_from_or_restarted_is_asked_for_a_dump() -> None:
    index = DocumentIndex()
    assert not index.apply(Announcement("a", "one", 1, (_stored("k"),)))
    assert index.holders("", "k") == {} and index.replicas() == []
    assert index.apply(Announcement("a", "one", 1, (_stored("k"),), full=True))
    assert index.apply(Announcement("a", "one", 2, (_stored("j"),)))
    assert not index.apply(Announcement("a", "two", 3, (_stored("m"),)))  # a new process
    assert index.holders("", "m") == {} and index.holders("", "j") == {"a": Tier.MEMORY}
    assert index.apply(Announcement("a", "two", 1, (_stored("m"),), full=True))
    assert index.holders("", "j") == {} and index.holders("", "m") == {"a": Tier.MEMORY}


def test_a_gap_is_refused_an_old_batch_ignored_and_an_overlap_applied_from_its_first_new_event() -> None:
    index = DocumentIndex()
    index.apply(Announcement("a", "i", 0, (), full=True))
    assert index.apply(Announcement("a", "i", 2, (_stored("k1"), HoldingEvent("evicted", "k1"))))
    assert not index.apply(Announcement("a", "i", 4, (_stored("k4"),)))  # event 3 is missing
    assert index.apply(Announcement("a", "i", 1, (_stored("old"),)))  # event 1 again: ignored
    assert index.holders("", "old") == {}
    # events 2..3: event 2 is known (here it disagrees, to show it is skipped), event 3 is new
    assert index.apply(Announcement("a", "i", 3, (_stored("k1"), _stored("k3"))))
    assert index.holders("", "k1") == {} and index.holders("", "k3") == {"a": Tier.MEMORY}
    assert index.apply(Announcement("a", "i", 3))  # a heartbeat


def test_clears_drop_one_namespace_or_everything_of_one_replica() -> None:
    index = DocumentIndex()
    events = (_stored("x", Tier.DISK, "t1"), _stored("y", Tier.HOST, "t2"), _stored("z", namespace="t1"))
    index.apply(Announcement("a", "i", 3, events, full=True))
    index.apply(Announcement("b", "i", 3, events, full=True))
    index.apply(Announcement("a", "i", 4, (HoldingEvent("cleared", namespace="t1"),)))
    assert index.holders("t1", "x") == {"b": Tier.DISK} and index.holders("t2", "y") == {"a": Tier.HOST, "b": Tier.HOST}
    index.apply(Announcement("b", "i", 4, (HoldingEvent("cleared", namespace=None),)))
    assert index.holders("t1", "x") == {} and index.holders("t2", "y") == {"a": Tier.HOST}
    assert (index.documents_of("a"), index.documents_of("b"), index.documents()) == (1, 0, 1)


def test_a_document_held_in_several_tiers_is_held_in_its_cheapest_and_only_in_its_namespace() -> None:
    index = DocumentIndex()
    index.apply(Announcement("a", "i", 2, (_stored("k", Tier.DISK, "t"), _stored("k", Tier.HOST, "t")), full=True))
    assert index.holders("t", "k") == {"a": Tier.HOST}
    assert index.holders("other", "k") == {}
    index.apply(Announcement("a", "i", 3, (HoldingEvent("evicted", "k", "t", Tier.HOST),)))
    assert index.holders("t", "k") == {"a": Tier.DISK}


def test_bad_events_are_refused_by_name() -> None:
    index = DocumentIndex()
    with pytest.raises(ValueError, match="other than stored"):
        index.apply(Announcement("a", "i", 1, (HoldingEvent("evicted", "k"),), full=True))
    index.apply(Announcement("a", "i", 0, (), full=True))
    with pytest.raises(ValueError, match="unknown holding event kind moved"):
        index.apply(Announcement("a", "i", 1, (HoldingEvent("moved", "k"),)))


def test_prefixes_match_whole_leading_blocks_and_die_with_their_replica() -> None:
    index = DocumentIndex()
    prompt = list(range(300))  # four whole blocks of 64, then 44 tokens
    index.record_prefix("a", prompt, "t")
    index.record_prefix("b", prompt[:130], "t")
    assert index.prefix_matched(prompt + [1], "t") == {"a": 256, "b": 128}
    assert index.prefix_matched(prompt, "other") == {}
    assert index.replicas() == ["a", "b"]
    index.forget("a")
    assert index.prefix_matched(prompt, "t") == {"b": 128} and index.replicas() == ["b"]


def test_a_forgotten_replicas_slot_is_reused_without_its_holdings() -> None:
    index = DocumentIndex()
    index.apply(Announcement("a", "i", 1, (_stored("k"),), full=True))
    index.forget("a")
    assert index.holders("", "k") == {} and index.documents() == 0 and index.replicas() == []
    assert not index.apply(Announcement("a", "i", 2, (_stored("j"),)))
    index.apply(Announcement("c", "i", 1, (_stored("j"),), full=True))  # takes the freed slot
    assert index.holders("", "j") == {"c": Tier.MEMORY} and index.holders("", "k") == {}


def test_thousands_of_keys_grow_the_table_and_stay_found() -> None:
    index, held = DocumentIndex(), {"a": set(), "b": set()}
    index.apply(Announcement("a", "i", 0, (), full=True))
    index.apply(Announcement("b", "i", 0, (), full=True))
    for seq, i in enumerate(range(6000), start=1):
        replica = "ab"[i % 2]
        index.apply(Announcement(replica, "i", seq // 2 + seq % 2, (_stored(f"doc{i}"),)))
        held[replica].add(f"doc{i}")
    evicted = [(f"doc{i}", "ab"[i % 2]) for i in range(0, 6000, 3)]
    for n, (key, replica) in enumerate(evicted):
        index.apply(Announcement(replica, "i", 3000 + n // 2 + 1, (HoldingEvent("evicted", key),)))
        held[replica].discard(key)
    for i in range(6000):
        key = f"doc{i}"
        assert index.holders("", key) == {r: Tier.MEMORY for r in held if key in held[r]}, key
    assert index.documents() == 4000 and index.documents_of("a") == len(held["a"])
