"""Ray Serve's request router for the replicas (``ReplicaRouter``), called as Ray Serve calls it, on
stand-in replicas: the order it offers them in, against the routing policy's own choice."""
import asyncio
from types import SimpleNamespace

import pytest

from hypic.cluster.index import Announcement, HoldingEvent, Tier
from hypic.cluster.ingress import ReplicaRouter
from hypic.cluster.routing import ReplicaLoad, RouteRequest, policy_named
from hypic.cluster.state import ClusterState, MeasuredRate, RouteTo, register_state

REQUEST = RouteRequest("t", (("d1", 1000), ("d2", 2000)), prompt_tokens=3100)


def _router(holder: str) -> ReplicaRouter:
    """A router over a cluster where ``holder`` holds both documents (Ray Serve's own state left out:
    ``choose_replicas`` reads only the cluster state and its arguments)."""
    state = ClusterState(policy_named("cache_aware"))
    events = tuple(HoldingEvent("stored", key, "t", Tier.MEMORY, 1) for key, _ in REQUEST.documents)
    assert state.announce(Announcement(holder, "i", len(events), events, full=True))
    register_state("test-request-router", state)
    router = object.__new__(ReplicaRouter)
    router.initialize_state("test-request-router")
    return router


def _offered(router: ReplicaRouter, route: RouteTo, replicas: list[str]) -> list[list[str]]:
    candidates = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in replicas]
    pending = SimpleNamespace(args=(route,), routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(router.choose_replicas(candidates, pending))
    assert pending.routing_context.should_backoff  # Ray Serve's retries back off instead of spinning
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_a_request_is_offered_to_the_holder_first_then_the_others_by_cost() -> None:
    offered = _offered(_router("r1"), RouteTo("a", REQUEST), ["r0", "r1", "r2"])
    assert offered == [["r1"], ["r0"], ["r2"]]  # r1 prefills 100 tokens, r0 and r2 3100 each (then by id)


def test_a_replica_that_refused_the_request_is_not_offered_it_again_while_another_is_left() -> None:
    router = _router("r1")
    assert _offered(router, RouteTo("b", REQUEST, avoid=frozenset({"r1"})), ["r0", "r1", "r2"]) == [["r0"], ["r2"]]
    assert _offered(router, RouteTo("c", REQUEST, avoid=frozenset({"r0", "r1", "r2"})), ["r0", "r1", "r2"]) == [
        ["r1"], ["r0"], ["r2"]]  # every one refused: all are offered again, the holder first


def test_a_call_for_one_replica_goes_to_it_alone_or_nowhere() -> None:
    router = _router("r1")
    assert _offered(router, RouteTo("d", replica="r2"), ["r0", "r1", "r2"]) == [["r2"]]
    assert _offered(router, RouteTo("e", replica="r9"), ["r0", "r1", "r2"]) == []  # not running (yet)


def _routed(router: ReplicaRouter, route: RouteTo, replica: str) -> None:
    router.on_request_routed(SimpleNamespace(args=(route,)), SimpleNamespace(unique_id=replica), None)  # type: ignore[arg-type]


def test_a_request_counts_as_routed_for_why_its_replica_was_chosen_and_nothing_is_kept_after() -> None:
    """Chosen by the router for what r1 holds: ``routed_by_cache``; placed by the ingress itself
    (its cold documents built elsewhere) for what r1 holds: ``routed_by_cache`` too, not "load";
    the reasons are forgotten once each request is routed."""
    router = _router("r1")
    state = router._state()
    _offered(router, RouteTo("chosen", REQUEST), ["r0", "r1", "r2"])
    _routed(router, RouteTo("chosen", REQUEST), "r1")
    _routed(router, RouteTo("placed", REQUEST, replica="r1", reason="cache"), "r1")
    _routed(router, RouteTo("unscored", REQUEST), "r0")  # routed without a choice kept: by load
    assert (state.counters["routed_by_cache"], state.counters["routed_by_load"]) == (2, 1)
    assert not state.reasons


def test_a_second_request_for_a_document_being_built_goes_where_it_is_built() -> None:
    """Two requests for one document no replica holds, both pools nearly full (a second copy would
    evict documents in use), the second routed while the first is still on its replica: it goes
    there too (one copy), not to the idle replica, which costs 2,100 + 2 x 0.9 x 2,000 x 2 = 9,300
    against 100 + 2,100 queued; once the first ends, what that replica holds is its holdings' word
    alone."""
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0", "r1"])
    state.pools_filled({"r0": 0.9, "r1": 0.9})
    request = RouteRequest("t", (("d", 2000),), 2100)
    first = state.choose(request, ["r0", "r1"])
    state.routed("k1", first.replica, request, 8)
    second = state.choose(request, ["r0", "r1"])
    assert second.replica == first.replica and state.index.holders("t", "d") == {first.replica: Tier.MEMORY}
    state.routed("k2", second.replica, request, 8)
    assert state.finished("k1") == first.replica and state.index.holders("t", "d") == {first.replica: Tier.MEMORY}
    state.finished("k2")
    assert state.index.holders("t", "d") == {} and state.index.pending() == 0  # never stored: not held
    state.routed("k3", "r1", request, 8)
    state.set_replicas(["r0"])  # r1 died with the request on it
    assert state.index.holders("t", "d") == {} and state.index.pending() == 0


def test_a_replica_gone_leaves_the_index_with_everything_it_held() -> None:
    """r0 held two documents in memory, one on disk and a prompt prefix; once Ray Serve no longer lists
    it, no lookup names it and a request for those documents costs each replica the whole prompt;
    news of it that was still on its way is not applied."""
    state = ClusterState(policy_named("cache_aware", decode_weight=0.0))
    state.set_replicas(["r0", "r1"])
    stored = tuple(HoldingEvent("stored", key, "t", tier, 500) for key, tier in
                   (("a", Tier.MEMORY), ("b", Tier.MEMORY), ("c", Tier.DISK)))
    assert state.announce(Announcement("r0", "i", 3, stored, full=True))
    state.index.record_prefix("r0", tuple(range(128)), "t")
    request = RouteRequest("t", (("a", 500), ("b", 500), ("c", 500)), 1600, tuple(range(128)))
    assert state.choose(request, ["r0", "r1"]).replica == "r0"
    assert state.index.prefix_matched(tuple(range(128)), "t") == {"r0": 128}
    state.set_replicas(["r1"])
    assert all(state.index.holders("t", key) == {} for key in "abc")
    assert state.index.prefix_matched(tuple(range(128)), "t") == {}
    late = Announcement("r0", "i", 4, (HoldingEvent("stored", "d", "t", Tier.MEMORY, 10),))
    assert state.announce(late) and state.index.holders("t", "d") == {}
    assert state.choose(request, ["r1"]).costs == {"r1": 1600.0}


def test_with_several_ingresses_a_replica_busy_with_the_others_work_is_passed_over() -> None:
    """Two ingresses share r0 and r1. This one sent r0 one request (1,000 cold tokens); r0's status
    counts 9,000 queued tokens and 3 requests, r1's nothing: the other ingress sent r0 8,000 tokens
    and 2 requests, which this one now counts too (its own are not counted twice). A cold 2,000-token
    request, which by this ingress's own count would go to r1 anyway, costs r0 2,000 + 9,000 and r1
    2,000; a request r0 holds the documents of (3,100 tokens, 100 to prefill there) still goes to r1
    once r0's queue is over twice the others' (the imbalance guard sees the other ingress's work)."""
    state = ClusterState(policy_named("cache_aware", decode_weight=0.0))
    state.set_replicas(["r0", "r1"])
    state.routed("own", "r0", RouteRequest("", (), 1000), 0)
    state.loads_reported({"r0": {"queued_prefill_tokens": 9000, "requests": 3, "decode_tokens": 0},
                          "r1": {"queued_prefill_tokens": 0, "requests": 0, "decode_tokens": 0}})
    with state.lock:
        loads = {load.replica: load for load in state.current_loads(["r0", "r1"])}
    assert (loads["r0"].queued_prefill_tokens, loads["r0"].running) == (9000, 3)
    assert state.loads["r0"].queued_prefill_tokens == 1000  # its own count is left as it is
    cold = state.choose(RouteRequest("", (("new", 2000),), 2000), ["r0", "r1"])
    assert cold.replica == "r1" and cold.costs == {"r0": 11000.0, "r1": 2000.0}
    events = tuple(HoldingEvent("stored", key, "t", Tier.MEMORY, 1) for key, _ in REQUEST.documents)
    assert state.announce(Announcement("r0", "i", len(events), events, full=True))
    assert state.choose(REQUEST, ["r0", "r1"]).replica == "r1"
    state.set_replicas(["r1"])
    assert "r0" not in state.foreign



def test_a_document_fetched_for_a_request_is_no_prefill_load_on_its_replica() -> None:
    """A request of 3,100 tokens whose 2,000-token document another replica sends: its replica's
    queued prefill grows by 1,100 (the rest), not 3,100; without the fetch, by 3,100."""
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0", "r1"])
    request = RouteRequest("t", (("d1", 1000), ("d2", 2000)), 3100)
    state.routed("fetching", "r0", request, 0, fetched=frozenset({"d2"}))
    state.routed("building", "r1", request, 0)
    assert (state.loads["r0"].queued_prefill_tokens, state.loads["r1"].queued_prefill_tokens) == (1100, 3100)


def test_a_replicas_prefill_rate_is_its_passes_mean_then_follows_each_report() -> None:
    """First report: 6,000 tokens in 3 s (2,000/s). Next: 3,000 more in 3 s (1,000/s): the rate moves
    a third of the way, to 1,666.7. A report of 0.1 s more work is too little to read a rate from
    (kept for the next). A replaced replica's counts start again from zero."""
    rate = MeasuredRate()
    rate.update(6000, 3.0)
    assert rate.per_s == pytest.approx(2000.0)
    rate.update(9000, 6.0)
    assert rate.per_s == pytest.approx(2000.0 - (2000.0 - 1000.0) / 3)
    rate.update(9500, 6.1)
    assert rate.per_s == pytest.approx(1666.667, abs=1e-3)
    rate.update(1000, 1.0)  # counts from zero: 1,000/s over its first second
    assert rate.per_s == pytest.approx(1666.667 + (1000 - 1666.667) / 3, abs=1e-3)


def test_the_predicted_time_to_first_token_is_the_queue_and_the_requests_own_prefill_at_each_rate() -> None:
    """r0 holds d (2,000 of the 2,100 tokens), has 1,000 queued and prefills 1,000 tokens/s: (1,000 +
    100) / 1,000 = 1.1 s. r1 holds nothing, nothing queued, 3,000 tokens/s: 2,100 / 3,000 = 0.7 s.
    r2 has never reported a pass: taken to work at the others' mean rate, 2,000 tokens/s: 1.05 s.
    Nothing decodes anywhere: no decode step counts."""
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0", "r1", "r2"])
    assert state.announce(Announcement("r0", "i", 1, (HoldingEvent("stored", "d", "t", Tier.MEMORY, 2000),), full=True))
    state.loads.setdefault("r0", ReplicaLoad("r0")).queued_prefill_tokens = 1000
    state.rates_reported({"r0": {"pass_tokens": 5000, "pass_seconds": 5.0},
                          "r1": {"pass_tokens": 9000, "pass_seconds": 3.0}})
    predicted = state.predicted_ttft(RouteRequest("t", (("d", 2000),), 2100), ["r0", "r1", "r2"])
    assert predicted == pytest.approx({"r0": 1.1, "r1": 0.7, "r2": 1.05})
