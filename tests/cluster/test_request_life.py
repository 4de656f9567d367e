"""A request's life at the ingress (``ReplicaLoop``) over stand-in replicas that answer by script:
which replica each try reaches, the load the router believes each replica has, the deadline on a
silent replica, the TTFT reported, and the service's totals when a replica is replaced."""
import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from hypic.cache.modes import Mode
from hypic.cluster import ingress
from hypic.cluster import state as state_module
from hypic.cluster.holdings import HoldingsMark
from hypic.cluster.index import Announcement, HoldingEvent, Tier
from hypic.cluster.ingress import ReplicaLoop
from hypic.cluster.replica import ALIVE, PREFILLED
from hypic.cluster.routing import ReplicaLoad, policy_named
from hypic.cluster.slo import SloRefusal
from hypic.cluster.state import ClusterState, RouteTo
from hypic.errors import HypicError
from hypic.prefill_stats import PrefillStats
from hypic.scheduler.jobs import DoneEvent, ErrorEvent
from hypic.scheduler.requests import Completion

PROMPT = (5, 6, 7, 8)
Script = Callable[[RouteTo], AsyncIterator[Any]]


def _done(ttft_s: float = 0.01) -> DoneEvent:
    """An end as a replica reports it: TTFT and latency from its own receipt of the call."""
    return DoneEvent(Completion("rid", [], list(PROMPT), PrefillStats(), ttft_s, ttft_s, Mode.parse("hypic")))


async def answers(route: RouteTo) -> AsyncIterator[Any]:
    yield [_done()]


async def dies(route: RouteTo) -> AsyncIterator[Any]:
    raise RuntimeError("the replica's actor died")
    yield  # an async generator


async def never_answers(route: RouteTo) -> AsyncIterator[Any]:
    await asyncio.sleep(3600)
    yield


class Stream:
    """A streamed call's answer as the ingress reads it: an async iterator that can be cancelled."""

    def __init__(self, messages: AsyncIterator[Any]) -> None:
        self.messages, self.cancelled = messages, False

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.messages

    def cancel(self) -> None:
        self.cancelled = True


class Holdings:
    """The holdings streams of stand-in replicas that hold nothing: a dump, then keepalives."""

    def remote(self, route: RouteTo, after: Any) -> Stream:
        return Stream(self._told(route.replica))

    @staticmethod
    async def _told(replica: str) -> AsyncIterator[Announcement]:
        while True:
            yield Announcement(replica, "i", 0, (), full=True)
            await asyncio.sleep(0.5)


class Replicas:
    """A deployment handle over stand-in replicas: a run call goes where Ray Serve's router would send
    it (the replica it is pinned to, else the policy's pick among those it does not avoid), is told
    to the state as routed, and is answered by that replica's script."""

    def __init__(self, state: ClusterState, scripts: dict[str, Script]) -> None:
        self.state, self.scripts = state, scripts
        self.calls: list[tuple[str, RouteTo, Stream]] = []
        state.set_replicas(sorted(scripts))

    def options(self, method_name: str, stream: bool = False) -> Any:
        assert method_name in ("run", "holdings")
        return self if method_name == "run" else Holdings()

    def remote(self, route: RouteTo, work: Any, *builds: Any) -> Stream:
        candidates = [r for r in self.state.replicas if r not in route.avoid] or self.state.replicas
        replica = route.replica or self.state.choose(route.request, candidates, key=route.key).replica
        self.state.routed(route.key, replica, route.request, route.decode_tokens,
                          route.reason if route.replica is not None else None)
        stream = Stream(self.scripts[replica](route))
        self.calls.append((replica, route, stream))
        return stream


def _job(rid: str) -> Any:
    plan = SimpleNamespace(documents=lambda: [], interior_tokens=lambda index: 0)
    request = SimpleNamespace(stream=False, params=SimpleNamespace(max_new_tokens=4))
    return SimpleNamespace(rid=rid, parts=SimpleNamespace(namespace="", token_ids=list(PROMPT)), plan=plan,
                           request=request, sequences=[None], start=time.perf_counter(), cancelled=threading.Event())


def _serve(loop: ReplicaLoop, rids: list[str], timeout_s: float = 5.0) -> list[Any]:
    """Send requests ``rids`` at once; the event each one ended with."""

    async def run() -> list[Any]:
        ends = [asyncio.get_running_loop().create_future() for _ in rids]
        for rid, end in zip(rids, ends):
            loop.enqueue(_job(rid), lambda event, end=end: end.done() or end.set_result(event))
        return list(await asyncio.wait_for(asyncio.gather(*ends), timeout_s))

    return asyncio.run(run())


def _loop(scripts: dict[str, Script], silence_s: float = 5.0) -> tuple[ReplicaLoop, Replicas, ClusterState]:
    state = ClusterState(policy_named("cache_aware"))
    replicas = Replicas(state, scripts)
    return ReplicaLoop(None, replicas, state, "hypic", None, spreads=False, silence_s=silence_s), replicas, state  # type: ignore[arg-type]


def _idle(state: ClusterState, replica: str) -> bool:
    load = state.loads[replica]
    return (load.running, load.queued_prefill_tokens, load.decode_tokens) == (0, 0, 0)


def test_two_requests_sent_with_one_rid_each_leave_their_replica_when_they_end() -> None:
    """A client may send one ``rid`` twice at once: each try is followed by a key of the ingress's own,
    so both requests' loads leave the replica (keyed by the rid, the second's record replaced the
    first's, and one request stayed running there forever)."""

    async def answers_later(route: RouteTo) -> AsyncIterator[Any]:
        await asyncio.sleep(0.1)
        yield [_done()]

    loop, replicas, state = _loop({"r0": answers_later})
    ends = _serve(loop, ["same", "same"])
    assert all(isinstance(end, DoneEvent) for end in ends)
    assert len({route.key for _, route, _ in replicas.calls}) == 2
    assert _idle(state, "r0") and not state.inflight


def test_a_retry_avoids_the_replica_that_failed_it() -> None:
    """r0 (the policy's pick: nothing is held, the lowest id wins ties) dies before answering; the
    retry is sent with r0 to avoid and reaches r1, and the client hears r1's answer."""
    loop, replicas, state = _loop({"r0": dies, "r1": answers})
    [end] = _serve(loop, ["q"])
    assert isinstance(end, DoneEvent)
    assert [(replica, route.avoid) for replica, route, _ in replicas.calls] == [("r0", frozenset()), ("r1", frozenset({"r0"}))]
    assert state.counters["retried"] == 1 and _idle(state, "r0") and _idle(state, "r1")


def test_a_silent_replica_is_given_up_within_the_deadline_and_the_request_served_elsewhere() -> None:
    """A call that never answers (pinned to a replica that left, waiting on builds that never come)
    is cancelled after ``silence_s`` and the request retried on another replica."""
    loop, replicas, state = _loop({"r0": never_answers, "r1": answers}, silence_s=0.3)
    start = time.perf_counter()
    [end] = _serve(loop, ["q"])
    assert isinstance(end, DoneEvent) and time.perf_counter() - start < 1.5
    assert [replica for replica, _, _ in replicas.calls] == ["r0", "r1"] and replicas.calls[0][2].cancelled
    assert _idle(state, "r0")


def test_a_replica_silent_past_the_deadline_with_none_left_fails_the_request_with_the_cause() -> None:
    loop, replicas, _ = _loop({"r0": never_answers}, silence_s=0.2)
    [end] = _serve(loop, ["q"])
    assert isinstance(end, ErrorEvent) and "sent nothing in 0.2 s" in end.message


def test_keepalives_hold_off_the_deadline_of_a_long_request() -> None:
    """The deadline is on silence, not on the request's length: a replica that says it is still at
    work every 0.1 s for 0.6 s answers a request whose deadline is 0.3 s."""

    async def works_long(route: RouteTo) -> AsyncIterator[Any]:
        for _ in range(6):
            await asyncio.sleep(0.1)
            yield ALIVE
        yield [_done()]

    loop, replicas, _ = _loop({"r0": works_long, "r1": answers}, silence_s=0.3)
    [end] = _serve(loop, ["q"])
    assert isinstance(end, DoneEvent) and [replica for replica, _, _ in replicas.calls] == ["r0"]


def test_the_ttft_counts_from_the_arrival_at_the_ingress() -> None:
    """A call whose replica starts 0.4 s after the ingress sent it (Ray Serve resolves the documents
    other replicas build before it delivers the call) reports the replica's 0.01 s as its own TTFT:
    the ingress reports its own from the request's arrival to the first token's, in the answer and
    in the service's TTFT histogram."""

    async def starts_late(route: RouteTo) -> AsyncIterator[Any]:
        await asyncio.sleep(0.4)
        yield PREFILLED
        await asyncio.sleep(0.1)
        yield [_done(ttft_s=0.01)]

    loop, _, _ = _loop({"r0": starts_late})
    [end] = _serve(loop, ["q"])
    assert 0.4 <= end.completion.ttft_s < 0.5 and end.completion.e2e_s >= 0.5
    snapshot = loop.snapshot
    assert snapshot["ttft_count"] == 1 and 0.4 <= snapshot["ttft_sum_s"] < 0.5
    assert snapshot["ttft_buckets"] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]  # bounds ... 0.25, 0.5, 1.0 ...


def test_a_requests_prefill_load_leaves_its_replica_when_its_prefill_is_done() -> None:
    """Once the first token is out the request no longer waits on the replica's prefill: its prompt
    leaves the replica's queued prefill (the router's main cost) while it still runs and decodes."""
    seen: list[tuple[int, int, int]] = []
    state_box: list[ClusterState] = []

    async def decodes(route: RouteTo) -> AsyncIterator[Any]:
        load = state_box[0].loads["r0"]
        seen.append((load.running, load.queued_prefill_tokens, load.decode_tokens))
        yield PREFILLED
        await asyncio.sleep(0.05)
        seen.append((load.running, load.queued_prefill_tokens, load.decode_tokens))
        yield [_done()]

    loop, _, state = _loop({"r0": decodes})
    state_box.append(state)
    _serve(loop, ["q"])
    assert seen == [(1, len(PROMPT), 4), (1, 0, 4)] and _idle(state, "r0")


class StatusHandle:
    """A deployment handle whose ``status`` calls answer with each replica's counters in ``finished``
    (requests finished, and one running), never for a replica missing from it."""

    def __init__(self, finished: dict[str, int]) -> None:
        self.finished = finished

    def options(self, method_name: str, stream: bool = False) -> Any:
        return self if method_name != "holdings" else Holdings()

    def remote(self, route: RouteTo) -> Any:
        return self._status(route.replica)

    async def _status(self, replica: str) -> dict[str, Any]:
        if replica not in self.finished:
            await asyncio.sleep(3600)
        return {"replica": replica, "pid": 1, "public_pool_fill": 0.0,
                "counters": {"running_requests": 1, "requests_finished": self.finished[replica],
                             "loop_errors": {f"step-{replica}": 1}}}


def test_a_replica_gone_leaves_the_report_while_a_refresh_still_waits_on_it() -> None:
    """Ray Serve says a replica died while the ingress waits for its status: the service's report
    (``snapshot``) names only the replica left and sums its gauges alone at once, though the
    refresh under way gives up on the dead one only after its timeout. Its pool's fill, read before
    it died, does not bring its load back."""
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0", "r1"])
    handle = StatusHandle({"r0": 3, "r1": 3})
    loop = ReplicaLoop(None, handle, state, "hypic", None, spreads=False)  # type: ignore[arg-type]

    async def report_after_death() -> tuple[list[str], list[str], Any]:
        await loop.refresh()
        before = [r["replica"] for r in loop.snapshot["data_parallel"]["replicas"]]
        del handle.finished["r1"]  # r1 is killed while its status is asked for
        refreshing = asyncio.ensure_future(loop.refresh())
        await asyncio.sleep(0.05)
        state.set_replicas(["r0"])
        report = loop.snapshot
        refreshing.cancel()
        return before, [r["replica"] for r in report["data_parallel"]["replicas"]], report

    before, after, report = asyncio.run(report_after_death())
    assert before == ["r0", "r1"] and after == ["r0"]
    assert report["running_requests"] == 1  # a gauge: r0's alone
    assert report["requests_finished"] == 6  # a total: r1's 3 stay counted (a service's totals never go back)
    state.pools_filled({"r1": 0.9})
    assert set(state.loads) <= {"r0"}


def test_the_services_totals_never_go_back_when_a_replica_is_replaced_or_slow_to_answer(monkeypatch: Any) -> None:
    """r0 finished 20 requests and is replaced by r2, which counts from 0: the service still reports
    r0's 20; a live replica whose status times out keeps its last counters, not none."""
    monkeypatch.setattr(ingress, "STATUS_TIMEOUT_S", 0.1)
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0", "r1"])
    handle = StatusHandle({"r0": 20, "r1": 4})
    loop = ReplicaLoop(None, handle, state, "hypic", None, spreads=False)  # type: ignore[arg-type]

    async def reports() -> list[dict[str, Any]]:
        await loop.refresh()
        first = loop.snapshot
        state.set_replicas(["r1", "r2"])  # r0 died; Ray Serve started r2
        handle.finished = {"r1": 5, "r2": 0}
        await loop.refresh()
        second = loop.snapshot
        handle.finished = {"r2": 3}  # r1 does not answer this refresh in time
        await loop.refresh()
        return [first, second, loop.snapshot]

    first, second, third = asyncio.run(reports())
    assert [r["requests_finished"] for r in (first, second, third)] == [24, 25, 28]
    assert second["running_requests"] == 2  # gauges: the live replicas' alone
    assert second["loop_errors"] == {"step-r0": 1, "step-r1": 1, "step-r2": 1}


class FlushHandle:
    """A deployment handle whose replicas flush as ``flushes`` says: counts, or an error raised."""

    def __init__(self, flushes: dict[str, Any]) -> None:
        self.flushes, self.method = flushes, ""

    def options(self, method_name: str, stream: bool = False) -> Any:
        self.method = method_name
        return self if method_name != "holdings" else Holdings()

    def remote(self, route: RouteTo, *args: Any) -> Any:
        return self._flush(route.replica) if self.method == "flush" else StatusHandle({route.replica: 0})._status(route.replica)

    async def _flush(self, replica: str) -> Any:
        outcome = self.flushes[replica]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome, HoldingsMark(replica, "i", 0)


def _flushed(flushes: dict[str, Any]) -> Any:
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(sorted(flushes))
    loop = ReplicaLoop(None, FlushHandle(flushes), state, "hypic", None, spreads=False)  # type: ignore[arg-type]

    async def flush() -> Any:
        loop.serve_on(asyncio.get_running_loop())
        return await asyncio.wrap_future(loop.flush(None, frozenset()))

    return asyncio.run(flush())


def test_a_replica_that_died_does_not_fail_the_services_flush_but_one_that_failed_does() -> None:
    """r0 died (its pools with it): the flush is the others'; a live replica's failure is the flush's,
    named (its pools still hold what the client asked to flush)."""
    assert _flushed({"r0": ActorDiedError(), "r1": (3, 2, 1), "r2": (1, 1, 1)}) == (4, 3, 2)
    with pytest.raises(HypicError, match="replica r1 could not flush: OSError: disk full"):
        _flushed({"r0": (1, 1, 1), "r1": OSError("disk full")})


def test_the_replicas_gone_are_remembered_up_to_a_bound(monkeypatch: Any) -> None:
    """Late news of a replica just gone is ignored; the set of those gone does not grow without end."""
    monkeypatch.setattr(state_module, "GONE_KEPT", 3)
    state = ClusterState(policy_named("cache_aware"))
    for number in range(10):
        state.set_replicas([f"r{number}"])
    assert list(state.gone) == ["r6", "r7", "r8"]
    late = Announcement("r8", "i", 1, (HoldingEvent("stored", "d", "", Tier.MEMORY, 5),), full=True)
    assert state.announce(late) and not state.index.holders("", "d")


class LateHoldings(Holdings):
    """Holdings streams whose news of document "d" comes 0.3 s after the replica stored it."""

    @staticmethod
    async def _told(replica: str) -> AsyncIterator[Announcement]:
        yield Announcement(replica, "i", 0, (), full=True)
        await asyncio.sleep(0.3)
        yield Announcement(replica, "i", 1, (HoldingEvent("stored", "d", "", Tier.MEMORY, 5),))
        while True:
            await asyncio.sleep(0.5)
            yield Announcement(replica, "i", 1)


def test_an_answer_goes_out_once_the_index_has_what_its_replica_held_then(monkeypatch: Any) -> None:
    """The replica answers with a mark of its holdings stream (event 1: document "d" stored) while
    the stream's news is still on its way: the client hears the end only once the index holds "d"
    there (its next request would route by it)."""

    async def stores_d(route: RouteTo) -> AsyncIterator[Any]:
        yield HoldingsMark("r0", "i", 1)
        yield [_done()]

    monkeypatch.setattr(sys.modules[__name__], "Holdings", LateHoldings)
    loop, _, state = _loop({"r0": stores_d})
    seen: list[dict[str, Tier]] = []

    async def run() -> None:
        loop.channel.sync()
        await loop.channel.heard_from_all(2.0)
        end = asyncio.get_running_loop().create_future()
        loop.enqueue(_job("q"), lambda event: end.done() or end.set_result(state.index.holders("", "d")))
        seen.append(await asyncio.wait_for(end, 5.0))
        loop.channel.close()

    asyncio.run(run())
    assert seen == [{"r0": Tier.MEMORY}]


class LoadedStatusHandle(StatusHandle):
    """``StatusHandle`` whose replicas also count their load: r0 5,000 queued tokens in 2 requests."""

    async def _status(self, replica: str) -> dict[str, Any]:
        status = await super()._status(replica)
        queued = 5000 if replica == "r0" else 0
        status["counters"]["load"] = {"queued_prefill_tokens": queued, "requests": 2 if queued else 0,
                                      "decode_tokens": 0}
        return status


@pytest.mark.parametrize("ingresses", [1, 2])
def test_the_replicas_own_load_counts_at_an_ingress_only_beside_other_ingresses(ingresses: int) -> None:
    """An ingress that sent nothing hears r0 count 5,000 queued tokens: beside another ingress, that is
    the other's work and routing counts it; alone, it is its own work already counted or ended since
    (a report is up to a second old), and routing goes by its own count."""
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0", "r1"])
    loop = ReplicaLoop(None, LoadedStatusHandle({"r0": 0, "r1": 0}), state, "hypic", None, spreads=False,  # type: ignore[arg-type]
                       ingresses=ingresses)
    asyncio.run(loop.refresh())
    with state.lock:
        queued = [load.queued_prefill_tokens for load in state.current_loads(["r0", "r1"])]
    assert queued == ([5000, 0] if ingresses > 1 else [0, 0])


class WarmupHandle(FlushHandle):
    """A deployment handle whose replicas warm their share (each document counted as its length in
    characters), except those in ``dead``, whose call fails as a killed replica's does."""

    def __init__(self, dead: set[str]) -> None:
        super().__init__({})
        self.dead, self.shares = dead, []

    def remote(self, route: RouteTo, *args: Any) -> Any:
        if self.method == "warmup":
            return self._warm(route.replica, args[0])
        return super().remote(route, *args)

    async def _warm(self, replica: str, documents: list[str]) -> Any:
        self.shares.append((replica, list(documents)))
        if replica in self.dead:
            raise ActorDiedError()
        return [len(d) for d in documents], HoldingsMark(replica, "i", 0)


def test_a_warm_up_share_whose_replica_dies_is_warmed_on_another() -> None:
    """Four documents spread over r0 and r1; r0 dies with its share: that share is warmed on r1, and
    every document's count comes back in order; with every replica dead the warm-up fails."""
    documents = ["a" * 40, "b" * 30, "c" * 20, "d" * 10]

    def warm(dead: set[str]) -> tuple[Any, list]:
        state = ClusterState(policy_named("cache_aware"))
        state.set_replicas(["r0", "r1"])
        handle = WarmupHandle(dead)
        front = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text: list(text)),
                                check_documents=lambda docs: None, policy=lambda mode: SimpleNamespace(caches_segments=True))
        loop = ReplicaLoop(front, handle, state, "hypic", None, spreads=False)  # type: ignore[arg-type]

        async def run() -> Any:
            loop.serve_on(asyncio.get_running_loop())
            return await asyncio.wrap_future(loop.warmup(documents, ""))

        return asyncio.run(run()), handle.shares

    counts, shares = warm({"r0"})
    assert counts == [40, 30, 20, 10]
    first = {replica for replica, _ in shares[:2]}
    assert first == {"r0", "r1"} and all(replica == "r1" for replica, _ in shares[2:])
    with pytest.raises(ActorDiedError):
        warm({"r0", "r1"})


def test_a_request_every_replica_would_answer_too_late_is_refused_at_once() -> None:
    """Both replicas measured 1,000 prompt tokens a second and have 3,000 and 5,000 queued: a request
    of its prompt's tokens would see its first token in (3,000 + its tokens) / 1,000 s at the soonest.
    With --ttft-slo 1 it is refused as busy (a 503) before any replica is called, within
    milliseconds, and counted; with 10 it runs."""
    loop, replicas, state = _loop({"r0": answers, "r1": answers})
    state.rates_reported({"r0": {"pass_tokens": 10_000, "pass_seconds": 10.0},
                          "r1": {"pass_tokens": 20_000, "pass_seconds": 20.0}})
    for replica, queued in (("r0", 3000), ("r1", 5000)):
        state.loads.setdefault(replica, ReplicaLoad(replica)).queued_prefill_tokens = queued
    loop.refusal = SloRefusal(ttft_s=1.0)
    start = time.perf_counter()
    [refused] = _serve(loop, ["late"])
    assert isinstance(refused, ErrorEvent) and refused.busy and time.perf_counter() - start < 0.05
    assert f"in {(3000 + len(PROMPT)) / 1000:.2f} s" in refused.message, refused.message
    assert replicas.calls == [] and state.counters["refused_for_slo"] == 1
    loop.refusal = SloRefusal(ttft_s=10.0)
    [served] = _serve(loop, ["in time"])
    assert isinstance(served, DoneEvent) and [replica for replica, _, _ in replicas.calls] == ["r0"]


def test_a_request_no_replica_would_decode_fast_enough_is_refused_at_once() -> None:
    """Both replicas measured 1,000 prompt tokens a second, a decode step of 0.05 s and 512-token
    chunks; r0 has 3,000 prefill tokens queued, r1 400: between two tokens r0 runs a step and a
    whole chunk (0.05 + 0.512 s), r1 a step and its 400 (0.45 s). With --tbt-slo 0.3 the request is
    refused as busy before any replica is called; with 0.5, r1 meets it and it runs."""
    loop, replicas, state = _loop({"r0": answers, "r1": answers})
    counters = {"pass_tokens": 10_000, "pass_seconds": 10.0, "decode_steps": 100, "decode_seconds": 5.0,
                "chunk_tokens": 512}
    state.rates_reported({"r0": counters, "r1": counters})
    for replica, queued in (("r0", 3000), ("r1", 400)):
        state.loads.setdefault(replica, ReplicaLoad(replica)).queued_prefill_tokens = queued
    assert state.predicted_tbt(["r0", "r1"]) == pytest.approx({"r0": 0.562, "r1": 0.45})
    loop.refusal = SloRefusal(tbt_s=0.3)
    start = time.perf_counter()
    [refused] = _serve(loop, ["slow"])
    assert isinstance(refused, ErrorEvent) and refused.busy and time.perf_counter() - start < 0.05
    assert "--tbt-slo of 0.3 s" in refused.message and "the least 0.45 s" in refused.message, refused.message
    assert replicas.calls == [] and state.counters["refused_for_slo"] == 1
    loop.refusal = SloRefusal(tbt_s=0.5)
    [served] = _serve(loop, ["fast enough"])
    assert isinstance(served, DoneEvent) and len(replicas.calls) == 1
