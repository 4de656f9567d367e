"""The ``ttft`` routing policy: each replica's predicted seconds to the first token at the rates it
measured, every expected cost worked out by hand; and the rates as the ingress reads them from the
replicas' counters."""
from dataclasses import astuple

import pytest

from hypic.cluster.index import Announcement, DocumentIndex, HoldingEvent, Tier
from hypic.cluster.routing import ReplicaLoad, ReplicaRates, RouteRequest, policy_named
from hypic.cluster.state import ClusterState

DOCS = (("d1", 1000), ("d2", 2000))
REQUEST = RouteRequest("t", DOCS, prompt_tokens=3100)  # 100 tokens besides the documents


def cluster(holdings: dict[str, list[str]]) -> DocumentIndex:
    """An index told by a dump from each replica which documents it holds in memory."""
    index = DocumentIndex()
    for replica, held in holdings.items():
        events = tuple(HoldingEvent("stored", key, "t", Tier.MEMORY, 1) for key in held)
        assert index.apply(Announcement(replica, "i", len(events), events, full=True))
    return index


def test_a_slow_holder_loses_to_a_fast_replica_that_would_prefill_everything() -> None:
    """r1 holds both documents (100 tokens to prefill) behind 1,000 queued, at 200 tokens/s: (1,000 +
    100) / 200 = 5.5 s. r0 holds nothing, at 1,000 tokens/s: 3,100 / 1,000 = 3.1 s, so r0 serves,
    where cache_aware's token count (1,100 against 3,100) sends it to r1. Once r1 measures 2,000
    tokens/s it is 0.55 s and serves."""
    index = cluster({"r0": [], "r1": ["d1", "d2"]})
    loads = [ReplicaLoad("r0", rates=ReplicaRates(1000.0)),
             ReplicaLoad("r1", queued_prefill_tokens=1000, rates=ReplicaRates(200.0))]
    decision = policy_named("ttft").choose(REQUEST, loads, index)
    assert decision.replica == "r0" and decision.costs == pytest.approx({"r0": 3.1, "r1": 5.5})
    assert policy_named("cache_aware").choose(REQUEST, loads, index).replica == "r1"
    loads[1].rates = ReplicaRates(2000.0)
    decision = policy_named("ttft").choose(REQUEST, loads, index)
    assert (decision.replica, decision.reason) == ("r1", "cache") and decision.costs["r1"] == pytest.approx(0.55)


def test_a_decoding_replica_adds_a_decode_step_between_its_prefill_chunks() -> None:
    """r1 holds both documents, has 1,000 queued and decodes (any budget) at 0.05 s a step, 512-token
    chunks: 1,100 tokens are 3 chunks, so half the step under way and 2 more: 1,100 / 1,000 + 2.5 x
    0.05 = 1.225 s. The decode budget's size does not count (cache_aware's 0.1 token a token would
    add 900 tokens at 9,000)."""
    index = cluster({"r0": [], "r1": ["d1", "d2"]})
    decoding = ReplicaRates(1000.0, decode_step_s=0.05, chunk_tokens=512)
    loads = [ReplicaLoad("r0", rates=decoding),
             ReplicaLoad("r1", queued_prefill_tokens=1000, decode_tokens=9000, rates=decoding)]
    costs = policy_named("ttft", imbalance_floor=10**9).choose(REQUEST, loads, index).costs
    assert costs == pytest.approx({"r0": 3.1, "r1": 1.1 + 2.5 * 0.05})
    loads[1].decode_tokens = 90_000
    assert policy_named("ttft", imbalance_floor=10**9).choose(REQUEST, loads, index).costs["r1"] == pytest.approx(1.225)


def test_a_document_in_another_replicas_memory_is_priced_at_the_rate_entries_reach_the_replica() -> None:
    """r0 holds both documents behind 2,000 queued (2.1 s at 1,000 tokens/s). r1 holds nothing but may
    fetch them: at 20,000 fetched tokens a second, a fetched token costs 1,000 / 20,000 = 0.05 of a
    prefilled one: (100 + 0.05 x 3,000) / 1,000 = 0.25 s, and r1 serves. Fetches measured at 500
    tokens/s, slower than its prefill, count as rebuilt: 3.1 s, and r0 serves. Not measured yet:
    the configured credit (0.2 here): (100 + 600) / 1,000 = 0.7 s."""
    index = cluster({"r0": ["d1", "d2"], "r1": []})
    policy = policy_named("ttft", fetch_credit=0.2, imbalance_floor=10**9)

    def choose(fetch_tokens_per_s: float | None):
        loads = [ReplicaLoad("r0", queued_prefill_tokens=2000, rates=ReplicaRates(1000.0)),
                 ReplicaLoad("r1", rates=ReplicaRates(1000.0, fetch_tokens_per_s=fetch_tokens_per_s))]
        return policy.choose(REQUEST, loads, index)

    fast = choose(20_000.0)
    assert fast.replica == "r1" and fast.costs == pytest.approx({"r0": 2.1, "r1": 0.25})
    slow = choose(500.0)
    assert slow.replica == "r0" and slow.costs["r1"] == pytest.approx(3.1)
    assert choose(None).costs["r1"] == pytest.approx(0.7)


def test_placement_terms_count_in_seconds_of_the_replicas_prefill() -> None:
    """Nobody holds the documents; r1's pool is full (fill 1), r0's empty: storing 3,000 new tokens
    there costs eviction_weight (2) x 3,000 prefill tokens later, 6,000 / 1,000 = 6 s on top of
    its 3.1 s; r0 costs 3.1 s and serves."""
    index = cluster({"r0": [], "r1": []})
    loads = [ReplicaLoad("r0", rates=ReplicaRates(1000.0)), ReplicaLoad("r1", pool_fill=1.0, rates=ReplicaRates(1000.0))]
    decision = policy_named("ttft").choose(REQUEST, loads, index)
    assert decision.replica == "r0" and decision.costs == pytest.approx({"r0": 3.1, "r1": 9.1})


def test_until_a_rate_is_measured_the_choice_is_cache_awares_in_tokens() -> None:
    index = cluster({"r0": [], "r1": ["d1", "d2"]})
    loads = [ReplicaLoad("r0"), ReplicaLoad("r1", queued_prefill_tokens=1000, decode_tokens=500)]
    assert policy_named("ttft").choose(REQUEST, loads, index) == policy_named("cache_aware").choose(REQUEST, loads, index)


def test_the_ingress_reads_each_replicas_rates_from_its_counters_and_fills_in_the_mean_for_a_new_one() -> None:
    """r0: 4,000 prompt tokens in 2 s of passes (2,000/s), 100 decode steps in 5 s (0.05 s a step),
    10,000 fetched tokens in 0.5 s of waiting (20,000/s), 512-token chunks. r1: 6,000 in 6 s
    (1,000/s), nothing else measured. r2 reported nothing: the mean of each rate measured (1,500
    tokens/s, 0.05 s, 20,000/s, 512). The ttft policy's prediction for a request of 3,100 cold
    tokens on r2 while it decodes: 3,100 / 1,500 + (7 chunks - 0.5) x 0.05 s."""
    state = ClusterState(policy_named("ttft"))
    state.set_replicas(["r0", "r1", "r2"])
    state.rates_reported({
        "r0": {"pass_tokens": 4000, "pass_seconds": 2.0, "decode_steps": 100, "decode_seconds": 5.0,
               "fetched_tokens": 10_000, "fetch_wait_seconds": 0.5, "chunk_tokens": 512},
        "r1": {"pass_tokens": 6000, "pass_seconds": 6.0, "decode_steps": 0, "decode_seconds": 0.0,
               "fetched_tokens": 0, "fetch_wait_seconds": 0.0, "chunk_tokens": 512}})
    with state.lock:
        loads = {load.replica: load for load in state.current_loads(["r0", "r1", "r2"])}
    assert astuple(loads["r0"].rates) == pytest.approx((2000.0, 0.05, 20_000.0, 512))
    assert loads["r1"].rates == ReplicaRates(1000.0, None, None, 512)
    assert astuple(loads["r2"].rates) == pytest.approx((1500.0, 0.05, 20_000.0, 512))
    state.loads.setdefault("r2", ReplicaLoad("r2")).decode_tokens = 100
    predicted = state.predicted_ttft(RouteRequest("t", (), 3100), ["r2"])
    assert predicted == pytest.approx({"r2": 3100 / 1500 + 6.5 * 0.05})
