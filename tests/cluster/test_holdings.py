"""A replica's holdings feed against the truth: an engine (a real one, with a pool small enough to
evict) caches, evicts and flushes documents in several namespaces while its feed's announcements,
some of them lost, are applied to a ``DocumentIndex``; after every step the index says the replica
holds a document exactly when the engine's memory holds it, and each announcement says how full the
pool is (its entries' bytes over the budget)."""
import random

import pytest

from hypic import Engine
from hypic.cli import parse_size
from hypic.cluster.index import DocumentIndex
from hypic.cluster.replica import HoldingsFeed

NAMESPACES = ("", "tenant-a", "tenant-b")


def _document(i: int) -> str:
    return f"Record {i}: the otter of place {i} was born in {1900 + i} and swam the river {i % 7} times a day."


def test_the_index_follows_what_memory_holds_through_eviction_flush_and_lost_announcements() -> None:
    rng = random.Random(5)
    engine = Engine.from_pretrained("default", dtype="float32", public_pool_bytes=parse_size("6M"))  # about four entries
    feed, index = HoldingsFeed(engine.cache, "r0"), DocumentIndex()
    seen: dict[str, str] = {}  # key -> namespace of every document ever cached
    for step in range(30):
        namespace, cleared = rng.choice(NAMESPACES), ()
        if step % 9 == 8:
            cleared = (rng.choice((None, namespace)),)
            engine.flush(cleared[0])
        else:
            engine.warmup([_document(rng.randrange(30)) for _ in range(rng.randint(1, 3))], namespace=namespace)
        for entry in engine.cache.held_documents(sorted(engine.cache.document_keys())):
            seen[entry.key] = entry.namespace
        announcement = feed.changes(cleared)
        held_bytes = sum(entry.nbytes for entry in engine.cache.held_documents(sorted(engine.cache.document_keys())))
        assert announcement.pool_fill == pytest.approx(held_bytes / parse_size("6M")), step
        if rng.random() < 0.2:
            continue  # lost on the way: the next one does not follow on, and a dump replaces it
        if not index.apply(announcement):
            assert index.apply(feed.dump())
        held = engine.cache.document_keys()
        assert {key for key, ns in seen.items() if "r0" in index.holders(ns, key)} == held, step
    assert len(seen) > len(engine.cache.document_keys())  # the pool did evict


def test_documents_memory_lets_go_of_are_told_as_held_on_disk(tmp_path) -> None:
    """With a disk tier below a pool of about four entries, a document memory evicted is still the
    replica's, on disk: after every warm-up the index names, for each document ever cached, memory if
    memory holds it, else disk if the disk tier loads it (the oracle reads the file), else nothing."""
    from hypic.cache.tiers.options import TierOptions
    from hypic.cluster.index import Tier

    rng = random.Random(7)
    engine = Engine.from_pretrained("default", dtype="float32", public_pool_bytes=parse_size("6M"),
                                    tiers=TierOptions(str(tmp_path / "disk")))
    feed, index = HoldingsFeed(engine.cache, "r0"), DocumentIndex()
    seen: dict[str, tuple[str, tuple[int, ...]]] = {}
    for step in range(12):
        engine.warmup([_document(rng.randrange(12)) for _ in range(rng.randint(1, 3))])
        engine.cache.drain()  # the writes to disk are done
        for entry in engine.cache.held_documents(sorted(engine.cache.document_keys())):
            seen[entry.key] = (entry.namespace, entry.token_ids)
        if not index.apply(feed.changes()):
            assert index.apply(feed.dump())
        memory = engine.cache.document_keys()
        for key, (namespace, ids) in seen.items():
            on_disk = engine.cache.public.lower.load(key, ids, namespace) is not None
            expected = Tier.MEMORY if key in memory else Tier.DISK if on_disk else None
            assert index.holders(namespace, key).get("r0") == expected, (step, key[:8])
    assert any(t == Tier.DISK for key, (ns, _) in seen.items() for t in index.holders(ns, key).values())
