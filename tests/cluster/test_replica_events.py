"""What a replica sends of its request's events: a batch's progress coalesced to each sample's
latest (the ingress sends its client what is new since the last chunk), nothing but the end for a
request that is not streamed. Expected lists worked out by hand."""
import asyncio
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from hypic.cluster import replica as replica_module
from hypic.cluster.replica import ALIVE, PREFILLED, RemoteBuilds, Replica, told
from hypic.prefill_stats import BuiltForRequest
from hypic.scheduler.loop import DoneEvent, ErrorEvent, ProgressEvent


def _progress(index: int, tag: str) -> ProgressEvent:
    return ProgressEvent(index, tag)  # type: ignore[arg-type] - the completion is only carried


def test_a_streamed_batch_keeps_each_samples_latest_progress_and_the_end() -> None:
    a0, b1, c0, d1 = _progress(0, "a"), _progress(1, "b"), _progress(0, "c"), _progress(1, "d")
    done = DoneEvent("end")  # type: ignore[arg-type]
    assert told([a0, b1, c0], streamed=True) == [c0, b1]
    assert told([a0, b1, c0, done], streamed=True) == [c0, b1, done]
    assert told([a0, done, d1], streamed=True) == [a0, done, d1]


def test_a_request_that_is_not_streamed_hears_only_how_it_ended() -> None:
    error = ErrorEvent("the loop stopped")
    assert told([_progress(0, "a"), _progress(1, "b")], streamed=False) == []
    assert told([_progress(0, "a"), error], streamed=False) == [error]


def test_the_replicas_counters_add_up_as_one_services() -> None:
    """Numbers add, lists add element by element, dicts key by key; a name is the first replica's."""
    from hypic.cluster.ingress import summed

    first = {"requests_finished": 3, "ttft_buckets": [1, 2], "public_pool": {"bytes": 10, "budget_bytes": None},
             "mode": "hypic"}
    second = {"requests_finished": 4, "ttft_buckets": [0, 5], "public_pool": {"bytes": 7, "budget_bytes": None},
              "mode": "hypic"}
    assert summed([first, second]) == {"requests_finished": 7, "ttft_buckets": [1, 7],
                                       "public_pool": {"bytes": 17, "budget_bytes": None}, "mode": "hypic"}


class TokenByToken:
    """A stand-in engine loop that emits a request's events one at a time, as decoding does: three
    tokens' progress, then the end."""

    alive, failure = True, None

    def enqueue(self, job: Any, emit: Any, peer_work: Any) -> None:
        def decode() -> None:
            for event in [_progress(0, "a"), _progress(0, "ab"), _progress(0, "abc"), DoneEvent("abc")]:  # type: ignore[arg-type]
                time.sleep(0.05)
                emit(event)
        threading.Thread(target=decode, daemon=True).start()


def _messages(streamed: bool) -> list[Any]:
    """Every message ``Replica.run`` sends the ingress for one request."""
    replica = object.__new__(Replica)
    replica.instance = SimpleNamespace(loop=TokenByToken(), close=lambda: None)
    replica.holdings_log = SimpleNamespace(mark=lambda: "holdings")
    replica._job = lambda work: SimpleNamespace(cancel=lambda: None)
    replica._stamped = lambda event: event
    work = SimpleNamespace(request=SimpleNamespace(stream=streamed))

    async def collect() -> list[Any]:
        return [message async for message in replica.run(None, work)]  # type: ignore[arg-type]

    return asyncio.run(collect())


def test_a_request_that_is_not_streamed_costs_one_message_for_its_end_not_one_per_token() -> None:
    """Each message is a call across processes: a request that is not streamed gets a mark when its
    first token is out (its prefill load leaves the replica; its TTFT is read there), what the
    replica holds and its end, nothing for the tokens between; a streamed one gets each token's
    progress (the first says the prefill is done)."""
    assert _messages(streamed=False) == [PREFILLED, "holdings", [DoneEvent("abc")]]  # type: ignore[arg-type]
    streamed = _messages(streamed=True)
    assert streamed[-2:] == ["holdings", [DoneEvent("abc")]]  # type: ignore[arg-type]
    assert [batch[-1].completion for batch in streamed[:-2]] == ["a", "ab", "abc"]


class StartsLate:
    """A stand-in engine loop whose request's one event comes 0.3 s after it is queued (a long prefill)."""

    alive, failure = True, None

    def enqueue(self, job: Any, emit: Any, peer_work: Any) -> None:
        threading.Timer(0.3, emit, [DoneEvent("late")]).start()  # type: ignore[arg-type]


def test_a_replica_at_work_says_so_while_its_request_has_nothing_to_send(monkeypatch: Any) -> None:
    """The ingress gives up on a stream silent past its deadline: a replica busy with a long prefill
    sends a keepalive every ``KEEPALIVE_S`` (here 0.05 s) until its request has news."""
    monkeypatch.setattr(replica_module, "KEEPALIVE_S", 0.05)
    replica = object.__new__(Replica)
    replica.instance = SimpleNamespace(loop=StartsLate(), close=lambda: None)
    replica.holdings_log = SimpleNamespace(mark=lambda: "holdings")
    replica._job = lambda work: SimpleNamespace(cancel=lambda: None)
    replica._stamped = lambda event: event

    async def collect() -> list[Any]:
        return [m async for m in replica.run(None, SimpleNamespace(request=SimpleNamespace(stream=True)))]  # type: ignore[arg-type]

    messages = asyncio.run(collect())
    assert messages[-2:] == ["holdings", [DoneEvent("late")]]  # type: ignore[arg-type]
    assert 3 <= len(messages[:-2]) <= 6 and set(messages[:-2]) == {ALIVE}


class BuildsHere:
    """A stand-in engine loop and cache for a replica's peer work: nothing held; ``run_steps`` notes
    when the replica's own builds were queued (and finishes them at once), ``call`` runs its step."""

    alive, failure, mode = True, None, "hypic"

    def __init__(self, own_builds_end: bool = True) -> None:
        self.queued_at: float | None = None
        self.own_builds_end = own_builds_end

    def run_steps(self, steps: Any, priority: float) -> Future:
        self.queued_at = time.perf_counter()
        return _finished([]) if self.own_builds_end else Future()  # a build stuck on this replica's loop

    def call(self, step: Any) -> Future:
        return _finished(step())


def _finished(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


ENTRY_B = SimpleNamespace(key="b", nbytes=100, token_ids=(3, 4, 5))  # document b's entry as another replica sends it


def _peer_outcome(monkeypatch: Any, arrives_after_s: float | None, timeout_s: float, own_builds_end: bool = True,
                  fetched: bool = False, lent: list | None = None) -> tuple[Any, float, float | None, list, dict]:
    """Start a replica's peer work for a request of documents "a" (its own to build) and "b" (built on
    another replica, or with ``fetched`` fetched from its pool, its entry arriving after
    ``arrives_after_s``; None: never); the outcome (or its error), when it came, when the own build
    was queued, what was installed, the replica's fetch counts. What was lent to the request goes to ``lent``."""
    installed: list = []
    monkeypatch.setattr(replica_module, "install_entries", lambda engine, entries, mode: installed.extend(entries))
    monkeypatch.setattr(replica_module, "lend_entries", lambda engine, entries, mode: [e.key for e in entries])
    loop = BuildsHere(own_builds_end)
    replica = object.__new__(Replica)
    cache = SimpleNamespace(document_keys=frozenset, lower_tiers_of=lambda key, namespace: [])
    replica.instance = SimpleNamespace(loop=loop, engine=SimpleNamespace(cache=cache), close=lambda: None)
    replica.fetches = {"fetched_documents": 0, "fetched_bytes": 0, "fetched_tokens": 0, "fetch_wait_seconds": 0.0}
    plan = SimpleNamespace(parts=SimpleNamespace(namespace=""), documents=lambda: [(0, "a", (1, 2)), (1, "b", (3, 4, 5))])

    async def run() -> tuple[Any, float]:
        entry: asyncio.Future = asyncio.get_running_loop().create_future()
        if arrives_after_s is not None:
            asyncio.get_running_loop().call_later(arrives_after_s, entry.set_result, [ENTRY_B])
        builds = RemoteBuilds((entry,), (), timeout_s, ("b",)) if fetched else RemoteBuilds((entry,), (("b", 3),), timeout_s)
        start = time.perf_counter()
        outcome = asyncio.wrap_future(replica._peer_work(builds, asyncio.get_running_loop(),
                                                         lent if lent is not None else [])(plan))
        done, _ = await asyncio.wait({outcome}, timeout=5)  # the test's own deadline
        if not done:
            return "no outcome in 5 s", start
        return (outcome.exception() or outcome.result()), start

    value, start = asyncio.run(run())
    return value, start, loop.queued_at, installed, replica.fetches


def test_a_replica_builds_its_own_documents_while_the_others_are_built_elsewhere(monkeypatch: Any) -> None:
    """The chosen replica queues its own cold document at once, not after the other replica's entry
    arrives (0.3 s later); the request's outcome waits for both and says what was built for it."""
    value, start, queued_at, installed, _ = _peer_outcome(monkeypatch, arrives_after_s=0.3, timeout_s=5.0)
    assert queued_at is not None and queued_at - start < 0.1
    assert value == (None, BuiltForRequest(frozenset({"a", "b"}), (("b", 3),))) and installed == [ENTRY_B]


def test_documents_that_never_come_from_another_replica_fail_the_peer_work_at_its_deadline(monkeypatch: Any) -> None:
    """A stuck builder: the outcome fails at the deadline (0.2 s), and the loop then prefills the
    request here alone, building what it misses; nothing late is installed."""
    value, start, _, installed, _ = _peer_outcome(monkeypatch, arrives_after_s=None, timeout_s=0.2)
    assert isinstance(value, TimeoutError) and time.perf_counter() - start < 2 and installed == []


def test_own_builds_that_do_not_end_fail_the_peer_work_at_the_same_deadline(monkeypatch: Any) -> None:
    """The other replica's entry comes at once, this replica's own build never ends: the outcome fails
    at the deadline (0.3 s) rather than waiting on its own loop for good."""
    value, start, _, installed, _ = _peer_outcome(monkeypatch, arrives_after_s=0.0, timeout_s=0.3, own_builds_end=False)
    assert isinstance(value, TimeoutError) and time.perf_counter() - start < 2 and installed == [ENTRY_B]


def test_a_document_fetched_from_another_replicas_pool_is_lent_to_the_request_and_counted_as_fetched(
        monkeypatch: Any) -> None:
    """b comes from another replica's pool, not built for the request: it is lent (not installed as a
    build), the outcome counts it as loaded from another replica (a hit, not a miss) and only a as
    built here."""
    lent: list[str] = []
    value, _, queued_at, installed, fetches = _peer_outcome(monkeypatch, arrives_after_s=0.05, timeout_s=5.0,
                                                            fetched=True, lent=lent)
    assert value == (None, BuiltForRequest(frozenset({"a"}), (), loaded=(("b", "replica"),)))
    assert installed == [] and lent == ["b"] and queued_at is not None
    assert (fetches["fetched_documents"], fetches["fetched_tokens"]) == (1, 3) and fetches["fetch_wait_seconds"] >= 0.05


def _head_outcome(monkeypatch: Any, arrives_after_s: float | None) -> tuple[Any, float, list, dict]:
    """Start a replica's peer work for a request of no documents whose prompt head another replica
    sends after ``arrives_after_s`` (None: never; this replica waits 0.3 s for a head); the outcome,
    how long it took, what the private pool was given to keep, and the replica's fetch counts."""
    monkeypatch.setattr(replica_module, "PREFIX_WAIT_S", 0.3)
    monkeypatch.setattr(replica_module, "install_entries", lambda engine, entries, mode: None)
    monkeypatch.setattr(replica_module, "lend_entries", lambda engine, entries, mode: [])
    kept: list = []
    replica = object.__new__(Replica)
    cache = SimpleNamespace(document_keys=frozenset, lower_tiers_of=lambda key, namespace: [],
                            install_prefix=lambda plan, state: kept.append(state) or state.length)
    replica.instance = SimpleNamespace(loop=BuildsHere(), engine=SimpleNamespace(cache=cache), close=lambda: None)
    replica.fetches = {"fetched_prefixes": 0, "fetched_prefix_tokens": 0, "fetched_tokens": 0, "fetch_wait_seconds": 0.0}
    plan = SimpleNamespace(parts=SimpleNamespace(namespace=""), documents=lambda: [])

    async def run() -> tuple[Any, float]:
        head: asyncio.Future = asyncio.get_running_loop().create_future()
        if arrives_after_s is not None:
            asyncio.get_running_loop().call_later(arrives_after_s, head.set_result, SimpleNamespace(length=256))
        start = time.perf_counter()
        builds = RemoteBuilds((), (), 5.0, (), head)
        outcome = asyncio.wrap_future(replica._peer_work(builds, asyncio.get_running_loop(), [])(plan))
        done, _ = await asyncio.wait({outcome}, timeout=5)  # the test's own deadline
        return ((outcome.exception() or outcome.result()) if done else "no outcome in 5 s"), time.perf_counter() - start

    value, took = asyncio.run(run())
    return value, took, kept, replica.fetches


def test_a_prompt_head_from_another_replica_is_kept_before_the_prefill_and_counted(monkeypatch: Any) -> None:
    value, took, kept, fetches = _head_outcome(monkeypatch, arrives_after_s=0.05)
    assert value == (None, BuiltForRequest(frozenset(), ())) and took >= 0.05
    assert [state.length for state in kept] == [256]
    assert (fetches["fetched_prefixes"], fetches["fetched_prefix_tokens"], fetches["fetched_tokens"]) == (1, 256, 256)
    assert 0.05 <= fetches["fetch_wait_seconds"] <= took  # what a router reads the fetch rate from


def test_a_prompt_head_that_never_comes_leaves_the_prefill_to_compute_it_after_a_short_wait(
        monkeypatch: Any, caplog: Any) -> None:
    """The sender is stuck: after 0.3 s the peer work ends anyway (the documents' part did not fail),
    nothing is kept or counted, and the log says why."""
    value, took, kept, fetches = _head_outcome(monkeypatch, arrives_after_s=None)
    assert value == (None, BuiltForRequest(frozenset(), ())) and 0.3 <= took < 2
    assert kept == [] and fetches["fetched_prefixes"] == 0
    assert "a prompt head from another replica was not taken (not within 0.3 s)" in caplog.text
