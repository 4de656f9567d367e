"""The routing policies replayed against stand-in replicas (least-recently-used pools, the real index):
on the cluster study's tenant workload, whose documents outgrow one replica's pool, ``cache_aware``
must keep about the hit rate of one pool as large as both (the oracle: that pool sees every request,
so it misses only what cannot fit), where a blind policy keeps about half of it."""
from dataclasses import replace

import pytest

from hypic.cluster.routing import policy_named
from hypic.evaluation.pool_replay import ReplayShape, StandInReplica, mean_hit_rate, replay_level
from hypic.evaluation.tenants import TenantConfig, TenantWorkload

DOC = 285
SEEDS = range(10)


def test_the_stand_in_pool_evicts_the_least_recently_used_document() -> None:
    """A pool of two 100-token documents: a, b stored; a read again; c pushes out b, not a."""
    replica = StandInReplica("r", pool_tokens=200)
    assert replica.serve((("a", 100), ("b", 100)))[:2] == ({"cold": 2}, 0)
    assert replica.serve((("a", 100),))[:2] == ({"hit": 1}, 100)
    counts, cached, events = replica.serve((("c", 100),))
    assert (counts, cached) == ({"cold": 1}, 0) and [(e.kind, e.key) for e in events] == [("stored", "c"), ("evicted", "b")]
    assert list(replica.held) == ["a", "c"] and replica.fill() == 1.0


@pytest.mark.parametrize("pool_documents", [25, 20])
def test_cache_aware_keeps_about_one_big_pools_hit_rate_where_blind_routing_halves_it(pool_documents: int) -> None:
    """Two busy replicas, each pool 25 (the study's ratio 1.9) or 20 of the 48 documents: the tenants
    must be split by room, whole, or one replica's pool churns. Ten workload seeds, one level each."""
    shape = ReplayShape(replicas=2, pool_tokens=pool_documents * DOC, doc_tokens=DOC, drain_tokens=150)
    pooled = mean_hit_rate(lambda: policy_named("round_robin"), TenantConfig(),
                           replace(shape, replicas=1, pool_tokens=2 * pool_documents * DOC), SEEDS)
    routed = mean_hit_rate(lambda: policy_named("cache_aware"), TenantConfig(), shape, SEEDS)
    blind = mean_hit_rate(lambda: policy_named("round_robin"), TenantConfig(), shape, SEEDS)
    assert pooled > 0.8
    assert routed >= 0.975 * pooled, (routed, pooled)
    assert blind < 0.6 * pooled, (blind, pooled)


def test_with_a_namespace_per_tenant_each_tenant_stays_on_one_replica() -> None:
    """Four busy replicas of 13 documents each, 8 tenants of 6 (two whole tenants fit a pool), every
    tenant's requests in its own namespace: at the end of each of ten seeds' levels no tenant's
    documents are held by two replicas (the stand-in pools say where every document is), and the hit
    rate is about one big pool's. Without the namespace term three seeds end with split tenants."""
    shape = ReplayShape(replicas=4, pool_tokens=13 * DOC, doc_tokens=DOC, drain_tokens=150)
    tenants = TenantConfig(tenant_namespaces=True)
    levels = [replay_level(policy_named("cache_aware"), TenantWorkload(replace(tenants, seed=seed)), shape)
              for seed in SEEDS]
    assert [level["split_tenants"] for level in levels] == [0] * len(SEEDS)
    pooled = mean_hit_rate(lambda: policy_named("round_robin"), tenants,
                           replace(shape, replicas=1, pool_tokens=4 * 13 * DOC), SEEDS)
    assert sum(level["segment_hit_rate"] for level in levels) / len(levels) >= 0.995 * pooled


def test_a_document_another_replica_holds_is_fetched_from_it_and_kept_only_if_asked() -> None:
    """r1 holds a; r0 serves a request for a and b: a is fetched from r1 (its use there makes it r1's
    most recent), b is built (no replica held it); the fetched copy is stored at r0 only with
    ``keep_fetched``. Without fetching, a is rebuilt though r1 held it."""
    for keep in (False, True):
        r0, r1 = StandInReplica("r0", 1000), StandInReplica("r1", 1000)
        r0.peers = r1.peers = [r0, r1]
        r1.serve((("a", 100), ("z", 100)))
        counts, cached, events = r0.serve((("a", 100), ("b", 100)), others=[r1], keep_fetched=keep)
        assert counts == {"fetched": 1, "cold": 1} and cached == 100 and list(r1.held) == ["z", "a"]
        assert [e.key for e in events] == (["a", "b"] if keep else ["b"]) and list(r0.held) == [e.key for e in events]
    r0, r1 = StandInReplica("r0", 1000), StandInReplica("r1", 1000)
    r0.peers = r1.peers = [r0, r1]
    r1.serve((("a", 100),))
    assert r0.serve((("a", 100), ("b", 100)))[:2] == ({"rebuilt": 1, "cold": 1}, 0)


def test_on_one_shared_corpus_fetching_keeps_one_big_pools_hit_rate_at_every_replica_count() -> None:
    """400 documents with Zipf popularity, 5 a request, pools of 1/N of 120 documents: routing by
    what each replica holds loses to one big pool as replicas grow (each rebuilds what another
    holds); fetching those instead (the copy not kept) keeps at least 0.95 of its hit rate at 2, 4
    and 8 replicas (three seeds)."""
    from hypic.evaluation.tenants import shared_corpus

    for replicas in (2, 4, 8):
        shape = ReplayShape(replicas, 120 // replicas * DOC, DOC, 300, warm=200, timed=400)
        pooled = mean_hit_rate(lambda: policy_named("round_robin"), shared_corpus(),
                               replace(shape, replicas=1, pool_tokens=120 // replicas * replicas * DOC), range(3))
        fetched = [replay_level(policy_named("cache_aware", fetch_credit=0.05), TenantWorkload(shared_corpus(seed=s)),
                                replace(shape, fetch=True, keep_fetched=False))["hit_rate_with_fetch"] for s in range(3)]
        rebuilt = mean_hit_rate(lambda: policy_named("cache_aware"), shared_corpus(), shape, range(3))
        assert sum(fetched) / 3 >= 0.95 * pooled and rebuilt < sum(fetched) / 3 - 0.05, (replicas, fetched, rebuilt, pooled)
