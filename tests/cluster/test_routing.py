"""Routing policies on small hand-built clusters, each expected choice and cost worked out by hand."""
import random

import pytest

from hypic.cluster.index import Announcement, DocumentIndex, HoldingEvent, Tier
from hypic.cluster.routing import (POLICIES, CacheAware, ReplicaLoad, RouteRequest, TierCosts, fetch_sources,
                                   holders_of, policy_named, prefix_source, spread_cold_documents, spread_documents)
from hypic.cluster.state import ClusterState


def cluster(holdings: dict[str, list[tuple[str, Tier]]], namespace: str = "t") -> DocumentIndex:
    """An index told by a dump from each replica what it holds."""
    index = DocumentIndex()
    for replica, held in holdings.items():
        events = tuple(HoldingEvent("stored", key, namespace, tier, 1) for key, tier in held)
        assert index.apply(Announcement(replica, "i", len(events), events, full=True))
    return index


def idle(*replicas: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(replica) for replica in replicas]


DOCS = (("d1", 1000), ("d2", 2000))
REQUEST = RouteRequest("t", DOCS, prompt_tokens=3100)  # 100 tokens besides the documents


def test_the_replica_holding_the_documents_wins_at_the_tokens_it_would_prefill() -> None:
    index = cluster({"r0": [], "r1": [("d1", Tier.MEMORY), ("d2", Tier.MEMORY)], "r2": [("d2", Tier.MEMORY)]})
    decision = policy_named("cache_aware").choose(REQUEST, idle("r0", "r1", "r2"), index)
    assert (decision.replica, decision.reason) == ("r1", "cache")
    assert decision.costs == {"r0": 3100, "r1": 100, "r2": 1100}


def test_tier_credits_order_memory_before_host_before_disk_before_a_miss() -> None:
    """(The namespace term, tested on its own below, is off here: d1 is new to a named namespace.)"""
    index = cluster({"disk": [("d2", Tier.DISK)], "host": [("d2", Tier.HOST)], "mem": [("d2", Tier.MEMORY)], "miss": []})
    policy = policy_named("cache_aware", tier_costs=TierCosts(host=0.05, disk=0.2), namespace_weight=0.0)
    loads = idle("disk", "host", "mem", "miss")
    decision = policy.choose(REQUEST, loads, index)
    assert decision.costs == {"mem": 1100, "host": 1100 + 0.05 * 2000, "disk": 1100 + 0.2 * 2000, "miss": 3100}
    assert decision.replica == "mem"
    index.forget("mem")
    assert policy.choose(REQUEST, loads, index).replica == "host"
    index.forget("host")
    assert policy.choose(REQUEST, loads, index).replica == "disk"
    index.forget("disk")
    assert policy.choose(REQUEST, loads, index).replica == "disk"  # nobody holds it: lowest id


def test_a_holder_pays_for_its_queue_and_its_decoding() -> None:
    """r1 holds both documents (100 to prefill), r0 nothing (3100): r1 wins until its queue and decode
    load pass 3000 tokens; decode counts 0.1 prefill token a token."""
    index = cluster({"r0": [], "r1": [("d1", Tier.MEMORY), ("d2", Tier.MEMORY)]})
    policy = policy_named("cache_aware", imbalance_floor=10**9)
    loads = [ReplicaLoad("r0"), ReplicaLoad("r1", queued_prefill_tokens=2000, decode_tokens=9000)]
    decision = policy.choose(REQUEST, loads, index)
    assert decision.costs == {"r0": 3100, "r1": 100 + 2000 + 900} and decision.replica == "r1"  # 3000 < 3100
    loads[1].decode_tokens = 11000
    decision = policy.choose(REQUEST, loads, index)
    assert decision.costs["r1"] == 3200 and (decision.replica, decision.reason) == ("r0", "load")


def test_ties_go_to_fewer_running_then_the_lowest_id() -> None:
    index = cluster({})
    policy = policy_named("cache_aware")
    loads = [ReplicaLoad("r2", running=1), ReplicaLoad("r1", running=3), ReplicaLoad("r3", running=1)]
    assert policy.choose(REQUEST, loads, index).replica == "r2"
    loads[0].running = 5
    assert policy.choose(REQUEST, loads, index).replica == "r3"


def test_an_overloaded_holder_is_skipped_even_when_it_is_cheapest() -> None:
    """r1 holds 30000 document tokens and has 25000 queued (mean queue 8333): cheapest at 25100, but
    above 2 x the mean and the 8192 floor, so r0 and r2 (30100 each) are left; the tie goes to r0."""
    big = RouteRequest("t", (("d1", 10000), ("d2", 20000)), prompt_tokens=30100)
    index = cluster({"r0": [], "r1": [("d1", Tier.MEMORY), ("d2", Tier.MEMORY)], "r2": []})
    policy = policy_named("cache_aware")
    loads = [ReplicaLoad("r0"), ReplicaLoad("r1", queued_prefill_tokens=25000), ReplicaLoad("r2")]
    decision = policy.choose(big, loads, index)
    assert (decision.replica, decision.reason) == ("r0", "load")
    assert decision.costs == {"r0": 30100, "r1": 25100, "r2": 30100}
    loads[1].queued_prefill_tokens = 8000  # above 2 x the mean (5333) but under the floor: kept
    decision = policy.choose(big, loads, index)
    assert (decision.replica, decision.reason) == ("r1", "cache")
    assert policy_named("cache_aware", imbalance_floor=4000).choose(big, loads, index).replica == "r0"


def test_of_two_replicas_the_one_queued_far_above_the_other_is_skipped() -> None:
    """r0 holds 30000 document tokens (100 to prefill) and has 20000 queued: cheapest at 20100 against
    r1's 30100, but above 2 x the other's queue (0) and the 8192 floor, so r1 takes it. (Against the
    mean of both, 10000, a busy replica of two could never be above twice it.)"""
    big = RouteRequest("t", (("d1", 10000), ("d2", 20000)), prompt_tokens=30100)
    index = cluster({"r0": [("d1", Tier.MEMORY), ("d2", Tier.MEMORY)], "r1": []})
    loads = [ReplicaLoad("r0", queued_prefill_tokens=20000), ReplicaLoad("r1")]
    decision = policy_named("cache_aware").choose(big, loads, index)
    assert (decision.replica, decision.reason) == ("r1", "load") and decision.costs == {"r0": 20100, "r1": 30100}
    loads[1].queued_prefill_tokens = 12000  # r0 under 2 x 12000: kept, and cheaper (20100 against 42100)
    assert policy_named("cache_aware").choose(big, loads, index).replica == "r0"


def test_when_every_replica_is_over_the_guard_the_cheapest_still_wins() -> None:
    index = cluster({"r0": [], "r1": [("d1", Tier.MEMORY), ("d2", Tier.MEMORY)]})
    policy = policy_named("cache_aware", imbalance_factor=0.5, imbalance_floor=0)
    loads = [ReplicaLoad("r0", queued_prefill_tokens=9000), ReplicaLoad("r1", queued_prefill_tokens=9000)]
    decision = policy.choose(REQUEST, loads, index)
    assert (decision.replica, decision.reason) == ("r1", "cache")


def test_a_held_prefix_counts_when_it_saves_more_than_the_documents() -> None:
    """A 640-token prompt without documents: r1 served it (ten whole blocks), r0 holds nothing."""
    prompt = tuple(range(640))
    index = cluster({})
    index.record_prefix("r1", prompt[:512], "t")
    request = RouteRequest("t", (), prompt_tokens=640, token_ids=prompt)
    decision = policy_named("cache_aware").choose(request, idle("r0", "r1"), index)
    assert decision.costs == {"r0": 640, "r1": 128} and (decision.replica, decision.reason) == ("r1", "cache")


def _prompt_of(order: list[str], tokens: dict[str, list[int]]) -> tuple[int, ...]:
    return tuple(t for name in order for t in tokens[name]) + tuple(range(9000, 9064))


def test_prefix_routing_misses_reordered_documents_that_cache_aware_finds() -> None:
    """r1 served [a, b, question] and keeps a and b in its public pool; the same documents come back as
    [b, a, question]. Only the leading prefix counts for ``prefix``: no match, so the tie goes to r0."""
    tokens = {"a": list(range(0, 640)), "b": list(range(1000, 1640))}
    index = cluster({"r0": [], "r1": [("a", Tier.MEMORY), ("b", Tier.MEMORY)]})
    first = _prompt_of(["a", "b"], tokens)
    index.record_prefix("r1", first, "t")
    again = RouteRequest("t", (("a", 640), ("b", 640)), len(first), first)
    reordered = RouteRequest("t", (("b", 640), ("a", 640)), len(first), _prompt_of(["b", "a"], tokens))
    prefix, cache_aware = policy_named("prefix"), policy_named("cache_aware")
    assert prefix.choose(again, idle("r0", "r1"), index).replica == "r1"
    decision = prefix.choose(reordered, idle("r0", "r1"), index)
    assert (decision.replica, decision.reason, decision.costs) == ("r0", "load", {"r0": 1344, "r1": 1344})
    decision = cache_aware.choose(reordered, idle("r0", "r1"), index)
    assert (decision.replica, decision.reason) == ("r1", "cache") and decision.costs["r1"] == 64


def test_prefix_routing_breaks_ties_by_the_queue() -> None:
    prompt = tuple(range(200))
    index = cluster({})
    index.record_prefix("r0", prompt, "t")
    index.record_prefix("r2", prompt, "t")
    loads = [ReplicaLoad("r0", queued_prefill_tokens=50), ReplicaLoad("r1"), ReplicaLoad("r2", queued_prefill_tokens=10)]
    decision = policy_named("prefix").choose(RouteRequest("t", (), 200, prompt), loads, index)
    assert (decision.replica, decision.reason) == ("r2", "cache")
    assert policy_named("prefix").choose(RouteRequest("t", (), 200, ()), loads, index).replica == "r1"


def test_round_robin_cycles_in_id_order_whatever_order_the_loads_come_in() -> None:
    policy = policy_named("round_robin")
    loads = idle("r2", "r0", "r1")
    chosen = [policy.choose(REQUEST, loads, DocumentIndex()).replica for _ in range(7)]
    assert chosen == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


def test_power_of_two_takes_the_less_busy_of_its_two_draws() -> None:
    draws = random.Random(5)
    loads = [ReplicaLoad(f"r{i}", queued_prefill_tokens=draws.randrange(100), running=draws.randrange(4))
             for i in range(6)]
    policy, mirror = policy_named("power_of_two", rng=random.Random(42)), random.Random(42)
    for _ in range(200):
        first, second = mirror.sample(loads, 2)
        better = first if (first.running, first.queued_prefill_tokens) < (second.running, second.queued_prefill_tokens) else second
        if (first.running, first.queued_prefill_tokens) == (second.running, second.queued_prefill_tokens):
            better = min(first, second, key=lambda load: load.replica)
        decision = policy.choose(REQUEST, loads, DocumentIndex())
        assert (decision.replica, decision.reason) == (better.replica, "random")
    assert policy_named("power_of_two").choose(REQUEST, idle("only"), DocumentIndex()).replica == "only"


def test_policies_are_named_and_a_wrong_name_or_option_says_which_are_valid() -> None:
    assert POLICIES == ("cache_aware", "ttft", "round_robin", "power_of_two", "prefix")
    assert [policy_named(name).name for name in POLICIES] == list(POLICIES)
    with pytest.raises(ValueError, match="unknown routing policy fastest: expected one of cache_aware, ttft, round_robin, power_of_two, prefix"):
        policy_named("fastest")
    with pytest.raises(ValueError, match="bad options for routing policy prefix"):
        policy_named("prefix", imbalance_factor=3)
    with pytest.raises(ValueError, match="no replicas"):
        policy_named("cache_aware").choose(REQUEST, [], DocumentIndex())


def test_tier_costs_are_prefill_time_over_load_time() -> None:
    costs = TierCosts.from_rates(prefill_tokens_per_s=10_000, host_tokens_per_s=200_000, disk_tokens_per_s=50_000)
    assert (costs.memory, costs.host, costs.disk) == (0.0, 0.05, 0.2)
    assert TierCosts.from_rates(10_000, 200_000, 5_000).disk == 1.0  # slower than prefilling it: a miss
    with pytest.raises(ValueError, match="> 0"):
        TierCosts.from_rates(10_000, 0, 1)


def test_warm_up_spreads_documents_longest_first_to_the_least_queued() -> None:
    """5 -> r0 (0 vs 4), 3 -> r1 (5 vs 4), 3 -> r0 (5 vs 7), 2 -> r1 (8 vs 7)."""
    loads = [ReplicaLoad("r0"), ReplicaLoad("r1", queued_prefill_tokens=4)]
    assert spread_documents([3, 5, 2, 3], loads) == ["r1", "r0", "r1", "r0"]


def _spread_request(tokens: list[int], rest: int) -> RouteRequest:
    return RouteRequest("", tuple((f"d{i}", t) for i, t in enumerate(tokens)), sum(tokens) + rest)


def test_cold_documents_are_spread_longest_first_to_the_least_loaded() -> None:
    """Idle replicas a, b, c; a serves a prompt of 40 tokens besides four cold documents of 400, 300,
    200 and 100 tokens. By hand, longest first to the least loaded (a starts at 40): 400 -> b,
    300 -> c, 200 -> a (240), 100 -> a (340): b builds document 0, c document 1, a keeps 2 and 3."""
    loads = [ReplicaLoad("a"), ReplicaLoad("b"), ReplicaLoad("c")]
    shares = spread_cold_documents(_spread_request([400, 300, 200, 100], 40), "a", loads, DocumentIndex())
    assert shares == {"b": [0], "c": [1]}


def test_documents_the_serving_replica_holds_or_short_ones_stay_with_it() -> None:
    """Documents the serving replica holds are never built elsewhere, nor ones under the minimum;
    a busy replica gets nothing (its queue already exceeds what the documents cost)."""
    index = DocumentIndex()
    loads = [ReplicaLoad("a"), ReplicaLoad("b"), ReplicaLoad("c", queued_prefill_tokens=10_000)]
    assert index.apply(Announcement("a", "i", 1, (HoldingEvent("stored", "d0", "", Tier.MEMORY, 400),), full=True))
    shares = spread_cold_documents(_spread_request([400, 300, 100, 300], 0), "a", loads, index, min_tokens=128)
    # d0 held by a, d2 too short; a computes the other 500 tokens anyway: d1 -> b (0), d3 -> b (300 < 500)
    assert shares == {"b": [1, 3]}


def test_a_document_in_the_shared_store_is_every_replicas_at_its_load_cost() -> None:
    """A document one replica reports in the shared store (Mooncake) saves every replica all but the
    shared tier's credit of its tokens (by hand: 400 x 0.3 = 120 left to pay), and one that holds it
    in memory pays nothing."""
    index, policy = DocumentIndex(), policy_named("cache_aware", tier_costs=TierCosts(shared=0.3))
    request = RouteRequest("", (("d0", 400),), 400)
    assert index.apply(Announcement("a", "i", 1, (HoldingEvent("stored", "d0", "", Tier.SHARED, 400),), full=True))
    assert policy.prefill_tokens(request, ["a", "b"], index) == {"a": 120.0, "b": 120.0}
    assert index.apply(Announcement("b", "j", 1, (HoldingEvent("stored", "d0", "", Tier.MEMORY, 400),), full=True))
    assert policy.prefill_tokens(request, ["a", "b", "c"], index) == {"a": 120.0, "b": 0.0, "c": 120.0}


def test_new_documents_go_where_the_pool_has_room_unless_another_holds_them() -> None:
    """Two idle replicas, a prompt of one 300-token document and 20 other tokens. Cold on both, the
    cost by hand: 320 + 1.0 x 300 x fill, so a (90 % full: 590) loses to b (10 % full: 350); once a
    holds the document, its cost is 20 however full it is, against b's 380 (a second copy's tokens
    count twice: 320 + 1.0 x 600 x 0.1)."""
    index, policy = DocumentIndex(), policy_named("cache_aware", eviction_weight=1.0, decode_weight=0.0)
    request = RouteRequest("", (("d0", 300),), 320)
    loads = [ReplicaLoad("a", pool_fill=0.9), ReplicaLoad("b", pool_fill=0.1)]
    decision = policy.choose(request, loads, index)
    assert decision.replica == "b" and decision.costs == pytest.approx({"a": 590.0, "b": 350.0})
    assert index.apply(Announcement("a", "i", 1, (HoldingEvent("stored", "d0", "", Tier.MEMORY, 300),), full=True))
    decision = policy.choose(request, [ReplicaLoad("a", pool_fill=1.0), ReplicaLoad("b", pool_fill=0.1)], index)
    assert decision.replica == "a" and decision.costs == pytest.approx({"a": 20.0, "b": 380.0})


def test_an_announced_pool_fill_steers_the_next_new_document_at_once() -> None:
    """The replicas' status comes once a second, but each answer's announcement says how full the pool
    is: right after replica a announces a 90 %-full pool (no status in between), a cold 300-token
    document goes to b. Costs by hand: a 320 + 300 x 0.9 = 590, b 320 + 300 x 0 = 320; before the
    announcement both cost 320 and the tie goes to a."""
    state = ClusterState(policy_named("cache_aware", eviction_weight=1.0, decode_weight=0.0))
    state.set_replicas(["a", "b"])
    request = RouteRequest("", (("d0", 300),), 320)
    assert state.choose(request, ["a", "b"]).replica == "a"
    assert state.announce(Announcement("a", "i", 0, (), full=True, pool_fill=0.9))
    decision = state.choose(request, ["a", "b"])
    assert decision.replica == "b" and decision.costs == pytest.approx({"a": 590.0, "b": 320.0})


def test_a_tenants_new_document_goes_where_most_of_its_namespace_is() -> None:
    """Namespace t: r1 holds two of its documents in memory, r0 one, r2 one on disk only (a namespace is
    where its documents are in memory: r2's counts for nothing). A request of t with one document no
    replica holds (1000 tokens, prompt 1100) costs 1100 + 0.5 x 1000 x the share of t held elsewhere:
    r0 1100 + 500 x 2/3, r1 1100 + 500 x 1/3, r2 1100 + 500. r1 wins, for what it holds. In the shared
    namespace "" (every tenant's) the same holdings say nothing: all cost 1100, the tie goes to r0."""
    policy = policy_named("cache_aware", namespace_weight=0.5, decode_weight=0.0)
    for namespace in ("t", ""):
        index = cluster({"r0": [("a1", Tier.MEMORY)], "r1": [("a2", Tier.MEMORY), ("a3", Tier.MEMORY)],
                         "r2": [("a4", Tier.DISK)]}, namespace)
        decision = policy.choose(RouteRequest(namespace, (("new", 1000),), 1100), idle("r0", "r1", "r2"), index)
        if namespace:
            assert (decision.replica, decision.reason) == ("r1", "cache")
            assert decision.costs == pytest.approx({"r0": 1100 + 1000 / 3, "r1": 1100 + 500 / 3, "r2": 1600})
        else:
            assert (decision.replica, decision.reason) == ("r0", "load")
            assert decision.costs == {"r0": 1100, "r1": 1100, "r2": 1100}


def test_only_documents_new_to_the_cluster_are_charged_for_leaving_their_namespace() -> None:
    """r0 holds a1 (namespace t), r1 holds a2 and a3. A request of a1 (1000 tokens) and a new document
    (500), prompt 1600: prefill r0 600, r1 1600; the namespace term charges the new document only:
    r0 0.5 x 500 x 2/3, r1 0.5 x 500 x 1/3 (a1, held by r0, is charged as a copy by the eviction term,
    off here with empty pools)."""
    index = cluster({"r0": [("a1", Tier.MEMORY)], "r1": [("a2", Tier.MEMORY), ("a3", Tier.MEMORY)]})
    policy = policy_named("cache_aware", namespace_weight=0.5, decode_weight=0.0)
    decision = policy.choose(RouteRequest("t", (("a1", 1000), ("new", 500)), 1600), idle("r0", "r1"), index)
    assert decision.replica == "r0"
    assert decision.costs == pytest.approx({"r0": 600 + 500 / 3, "r1": 1600 + 250 / 3})


def test_where_documents_can_be_fetched_a_request_goes_by_load_not_to_their_holder() -> None:
    """a holds d1 and d2 (3,000 tokens) and has 2,000 tokens queued; b is idle. Rebuilding what a holds
    elsewhere (today), b costs 3,100 and a 100 + 2,000: a wins. If the replicas fetch what another
    holds at 5 % of its tokens, b costs 100 + 0.05 x 3,000 = 250 against a's 2,100: b wins, and a
    document no replica holds is still counted whole."""
    index = cluster({"a": [("d1", Tier.MEMORY), ("d2", Tier.MEMORY)]})
    loads = [ReplicaLoad("a", queued_prefill_tokens=2000), ReplicaLoad("b")]
    weights = {"decode_weight": 0.0, "eviction_weight": 0.0, "namespace_weight": 0.0}
    rebuild, fetch = policy_named("cache_aware", **weights), policy_named("cache_aware", **weights, fetch_credit=0.05)
    assert rebuild.choose(REQUEST, loads, index).costs == pytest.approx({"a": 2100.0, "b": 3100.0})
    decision = fetch.choose(REQUEST, loads, index)
    assert decision.replica == "b" and decision.costs == pytest.approx({"a": 2100.0, "b": 250.0})
    cold = RouteRequest("t", (("d1", 1000), ("new", 500)), 1600)
    assert fetch.choose(cold, loads, index).costs == pytest.approx({"a": 2600.0, "b": 650.0})


def test_the_documents_a_replica_lacks_come_from_the_least_loaded_replica_holding_them() -> None:
    """c serves a request of d1 (held in memory by a and b), d2 (held by b), d3 (no one), d4 (c's own
    disk holds it) and d5 (held by a, 100 tokens). With b less queued than a, d1 and d2 come from b,
    d5 from a (unless short documents are left to be built: ``min_tokens``); d4 is not fetched. The
    cold d3 is left to the builds, which place it on the least queued counting c's rest of the prompt
    (2,200 - 500 = 1,700 tokens): b's 300."""
    index = cluster({"a": [("d1", Tier.MEMORY), ("d5", Tier.MEMORY)], "b": [("d1", Tier.MEMORY), ("d2", Tier.MEMORY)],
                     "c": [("d4", Tier.DISK)]})
    request = RouteRequest("t", (("d1", 500), ("d2", 500), ("d3", 500), ("d4", 500), ("d5", 100)), 2200)
    loads = [ReplicaLoad("a", queued_prefill_tokens=900), ReplicaLoad("b", queued_prefill_tokens=300), ReplicaLoad("c")]
    assert fetch_sources(request, "c", loads, index) == {"b": [0, 1], "a": [4]}
    assert fetch_sources(request, "c", loads, index, min_tokens=128) == {"b": [0, 1]}
    assert spread_cold_documents(request, "c", loads, index, fetched=frozenset({0, 1})) == {"b": [2]}


def test_a_prompt_head_comes_from_the_replica_holding_the_longest_of_it_when_that_is_a_block_longer() -> None:
    """A 704-token prompt with no documents: a served its first 640 tokens (whole blocks of 64: 640
    believed held), b its first 128, c nothing. Served on c, the head comes from a (b's is shorter);
    on b, from a too (512 more); on a, from nobody. A head no more than 63 tokens longer than the
    server's own is computed there. With fetching, every replica is charged as holding 0.95 x 640
    (c: 704 - 608 = 96 tokens; a its own 64); without, each its own."""
    index = DocumentIndex()
    prompt = tuple(range(704))
    index.record_prefix("a", prompt[:640], "t")
    index.record_prefix("b", prompt[:128], "t")
    request = RouteRequest("t", (), 704, prompt)
    loads = [ReplicaLoad("a", queued_prefill_tokens=5000), ReplicaLoad("b"), ReplicaLoad("c")]
    assert [prefix_source(request, replica, loads, index) for replica in "abc"] == [None, "a", "a"]
    assert prefix_source(request, "b", loads, index, min_tokens=513) is None
    weights = {"decode_weight": 0.0, "eviction_weight": 0.0, "namespace_weight": 0.0}
    fetch = policy_named("cache_aware", **weights, fetch_credit=0.05).choose(request, loads, index)
    assert fetch.costs == pytest.approx({"a": 5064.0, "b": 96.0, "c": 96.0}) and fetch.replica == "b"
    rebuild = policy_named("cache_aware", **weights).choose(request, loads, index)
    assert rebuild.costs == pytest.approx({"a": 5064.0, "b": 576.0, "c": 704.0})


def _naive_prefill(policy, request: RouteRequest, replicas: list[str], index: DocumentIndex,
                   credits: dict[str, float] | None) -> dict[str, float]:
    """The tokens each replica would prefill, replica by replica and document by document, as the
    policy's cost defines them (the oracle of its totals-and-holders computation)."""
    costs = policy.tier_costs
    prefill = {}
    for replica in replicas:
        saved = 0.0
        for key, tokens in request.documents:
            holders = index.holders(request.namespace, key)
            options = [tokens * (1 - costs.shared)] if index.shared(request.namespace, key) else []
            if credits is not None and Tier.MEMORY in holders.values():
                options.append(tokens * (1 - credits[replica]))
            if replica in holders:
                options.append(tokens * (1 - costs.of(holders[replica])))
            saved += max(options, default=0.0)
        matched = index.prefix_matched(request.token_ids, request.namespace)
        head = matched.get(replica, 0)
        if credits is not None and matched:
            head = max(head, max(matched.values()) * (1 - credits[replica]))
        rest = request.prompt_tokens - request.document_tokens()
        prefill[replica] = min(request.document_tokens() - saved + rest, max(0, request.prompt_tokens - head))
    return prefill


def test_the_tokens_to_prefill_equal_a_replica_by_replica_count_on_random_clusters() -> None:
    """200 random clusters (2-6 replicas, 1-5 documents each held in 0-3 replicas' tiers, some in the
    shared store, prompt heads recorded; no fetching, one fetch credit for all or one per replica): every replica's tokens
    as ``_naive_prefill`` counts them."""
    rng = random.Random(7)
    for case in range(200):
        replicas = [f"r{i}" for i in range(rng.randint(2, 6))]
        documents = tuple((f"d{i}", rng.choice([64, 100, 700])) for i in range(rng.randint(1, 5)))
        token_ids = tuple(range(sum(t for _, t in documents) + 40))
        index = DocumentIndex()
        for replica in replicas:
            held = [HoldingEvent("stored", key, "t", rng.choice([Tier.MEMORY, Tier.HOST, Tier.DISK, Tier.SHARED]), tokens)
                    for key, tokens in documents if rng.random() < 0.35]
            assert index.apply(Announcement(replica, "i", len(held), tuple(held), full=True))
            if rng.random() < 0.3:
                index.record_prefix(replica, token_ids[: rng.choice([64, 128, 400])], "t")
        request = RouteRequest("t", documents, len(token_ids), token_ids)
        kind = rng.choice(["none", "one", "each"])  # no fetching, cache_aware's one credit, ttft's per replica
        credits = None if kind == "none" else {r: 0.05 if kind == "one" else rng.choice([0.05, 0.5, 1.0]) for r in replicas}
        policy = CacheAware(fetch_credit=None if credits is None else 0.05)
        got = policy._prefill(request, replicas, holders_of(request, index), index, credits if kind == "each" else None)
        assert got == pytest.approx(_naive_prefill(policy, request, replicas, index, credits)), case
