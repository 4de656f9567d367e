"""A replica's holdings log against the truth: an engine (a real one, with a pool small enough to
evict) caches, evicts and flushes documents in several namespaces while a follower reads the log's
stream into a ``DocumentIndex``, some messages lost on the way (the follower then asks again from
where it was, or from nothing); after every step the index says the replica holds a document
exactly where the engine holds it: memory per its pool, disk per a load of the file."""
import random
import threading

import pytest

from hypic import Engine
from hypic.cache.tiers.options import TierOptions
from hypic.cli import parse_size
from hypic.cluster.holdings import HoldingsLog, holdings_of
from hypic.cluster.index import Announcement, DocumentIndex, Tier

NAMESPACES = ("", "tenant-a", "tenant-b")


def _document(i: int) -> str:
    return f"Record {i}: the otter of place {i} was born in {1900 + i} and swam the river {i % 7} times a day."


class Follower:
    """Reads a log as an ingress would; a message may be lost (the next read starts where the last
    one applied left off) or the follower may start over (a dump)."""

    def __init__(self, log: HoldingsLog) -> None:
        self.log, self.index, self.after = log, DocumentIndex(), None
        self.dumps = 0

    def read(self, lost: bool = False) -> Announcement:
        told = self.log.since(self.after)
        if not lost:
            self.dumps += told.full
            assert self.index.apply(told)
            self.after = (told.incarnation, told.seq)
        return told


def _flush(engine: Engine, log: HoldingsLog, namespace: str | None) -> None:
    engine.flush(namespace)
    log.cleared(namespace)  # what the replica adds to a flush of memory


def test_the_index_follows_what_memory_holds_through_eviction_flush_and_lost_messages() -> None:
    rng = random.Random(5)
    engine = Engine.from_pretrained("default", dtype="float32", public_pool_bytes=parse_size("6M"))  # about four entries
    log = holdings_of(engine.cache, "r0")
    follower = Follower(log)
    seen: dict[str, str] = {}  # key -> namespace of every document ever cached
    for step in range(30):
        namespace = rng.choice(NAMESPACES)
        if step % 9 == 8:
            _flush(engine, log, rng.choice((None, namespace)))
        else:
            engine.warmup([_document(rng.randrange(30)) for _ in range(rng.randint(1, 3))], namespace=namespace)
        held = engine.cache.held_documents(sorted(engine.cache.document_keys()))
        seen |= {entry.key: entry.namespace for entry in held}
        if rng.random() < 0.2:
            follower.read(lost=True)
            continue
        told = follower.read()
        assert told.pool_fill == pytest.approx(sum(entry.nbytes for entry in held) / parse_size("6M")), step
        assert {key for key, ns in seen.items() if "r0" in follower.index.holders(ns, key)} == engine.cache.document_keys(), step
    assert len(seen) > len(engine.cache.document_keys())  # the pool did evict
    assert follower.dumps == 1  # lost messages were replayed from the log, not dumped


def test_a_follower_the_log_no_longer_reaches_back_to_is_sent_a_dump() -> None:
    """A log of 6 events: a follower more than 6 behind gets everything held, and then its index is
    right again."""
    engine = Engine.from_pretrained("default", dtype="float32", public_pool_bytes=parse_size("6M"))
    log = holdings_of(engine.cache, "r0")
    log.log = type(log.log)(maxlen=6)
    follower = Follower(log)
    follower.read()
    engine.warmup([_document(i) for i in range(2)])
    assert not follower.read().full  # 2 events behind: replayed
    for i in range(2, 12):  # stores 10, evicts some: more than 6 events
        engine.warmup([_document(i)])
    told = follower.read()
    assert told.full and follower.dumps == 2
    held = {entry.key: entry.namespace for entry in engine.cache.held_documents(sorted(engine.cache.document_keys()))}
    assert {key for key, ns in held.items() if follower.index.holders(ns, key) == {"r0": Tier.MEMORY}} == set(held)
    assert follower.index.documents() == len(held)


def test_documents_memory_and_disk_let_go_of_are_told_where_they_are_still_held(tmp_path) -> None:
    """With a disk tier (about six entries) below a pool of about four, after every warm-up the
    index names, for each document ever cached, memory if memory holds it, else disk if the disk tier
    loads it (the oracle reads the file), else nothing."""
    rng = random.Random(7)
    engine = Engine.from_pretrained("default", dtype="float32", public_pool_bytes=parse_size("6M"),
                                    tiers=TierOptions(str(tmp_path / "disk"), disk_bytes=parse_size("9M")))
    follower = Follower(holdings_of(engine.cache, "r0"))
    seen: dict[str, tuple[str, tuple[int, ...]]] = {}
    for step in range(14):
        engine.warmup([_document(rng.randrange(14)) for _ in range(rng.randint(1, 3))])
        engine.cache.drain()  # the writes to disk are done
        seen |= {e.key: (e.namespace, e.token_ids) for e in engine.cache.held_documents(sorted(engine.cache.document_keys()))}
        follower.read()
        memory = engine.cache.document_keys()
        for key, (namespace, ids) in seen.items():
            on_disk = key not in memory and engine.cache.public.lower.load(key, ids, namespace) is not None
            expected = Tier.MEMORY if key in memory else Tier.DISK if on_disk else None
            assert follower.index.holders(namespace, key).get("r0") == expected, (step, key[:8])
    told = {t for key, (ns, _) in seen.items() for t in follower.index.holders(ns, key).values()}
    assert Tier.DISK in told and any(not follower.index.holders(ns, key) for key, (ns, _) in seen.items())


def test_a_restarted_replica_announces_what_its_disk_holds(tmp_path) -> None:
    """A server caches documents on disk and stops; a new one on the same directory, its memory
    empty, tells a new follower of every one of them as held on disk (read from the files' headers,
    the oracle: the documents the first server wrote), and none of another model's files."""
    options = TierOptions(str(tmp_path / "disk"))
    first = Engine.from_pretrained("default", dtype="float32", tiers=options)
    first.warmup([_document(i) for i in range(5)], namespace="tenant-a")
    written = {e.key for e in first.cache.held_documents(sorted(first.cache.document_keys()))}
    first.close()
    other = Engine.from_pretrained("default", dtype="bfloat16", tiers=options)  # another dtype: files not ours
    other.warmup([_document(9)])
    other.close()
    second = Engine.from_pretrained("default", dtype="float32", tiers=options)
    log = holdings_of(second.cache, "r1")
    scans = [t for t in threading.enumerate() if t.name == "hypic-holdings-scan"]
    for scan in scans:
        scan.join(timeout=30)
    follower = Follower(log)
    follower.read()
    assert {key for key in written if follower.index.holders("tenant-a", key) == {"r1": Tier.DISK}} == written
    assert follower.index.documents() == len(written)
    second.close()


def test_a_flush_of_memory_forgets_the_replicas_prompt_prefixes_but_not_what_its_disk_holds(tmp_path) -> None:
    """A flush of memory: the index forgets the prompt prefixes it believed the replica's private pool
    held, and the replica's documents, gone from memory, are still its on disk (the files are there)."""
    engine = Engine.from_pretrained("default", dtype="float32", tiers=TierOptions(str(tmp_path / "disk")))
    log = holdings_of(engine.cache, "r0")
    follower = Follower(log)
    engine.warmup([_document(i) for i in range(3)])
    engine.cache.drain()
    held = {e.key: e for e in engine.cache.held_documents(sorted(engine.cache.document_keys()))}
    follower.read()
    follower.index.record_prefix("r0", tuple(range(256)))
    assert follower.index.prefix_matched(tuple(range(256))) == {"r0": 256}
    _flush(engine, log, None)
    follower.read()
    assert follower.index.prefix_matched(tuple(range(256))) == {} and not engine.cache.document_keys()
    for key, entry in held.items():
        assert engine.cache.public.lower.load(key, entry.token_ids, "") is not None
        assert follower.index.holders("", key) == {"r0": Tier.DISK}
