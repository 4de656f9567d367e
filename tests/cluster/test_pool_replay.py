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
    assert replica.serve((("a", 100), ("b", 100)))[:2] == (0, 0)
    assert replica.serve((("a", 100),))[:2] == (1, 100)
    hits, cached, events = replica.serve((("c", 100),))
    assert (hits, cached) == (0, 0) and [(e.kind, e.key) for e in events] == [("stored", "c"), ("evicted", "b")]
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
