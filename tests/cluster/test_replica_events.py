"""What a replica sends of its request's events: a batch's progress coalesced to each sample's
latest (the ingress sends its client what is new since the last chunk), nothing but the end for a
request that is not streamed. Expected lists worked out by hand."""
import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

from hypic.cluster.replica import Replica, told
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
    replica.feed = SimpleNamespace(changes=lambda: "holdings")
    replica._job = lambda work: SimpleNamespace(cancel=lambda: None)
    replica._stamped = lambda event: event
    work = SimpleNamespace(request=SimpleNamespace(stream=streamed))

    async def collect() -> list[Any]:
        return [message async for message in replica.run(None, work)]  # type: ignore[arg-type]

    return asyncio.run(collect())


def test_a_request_that_is_not_streamed_costs_one_message_for_its_end_not_one_per_token() -> None:
    """Each message is a call across processes: a request that is not streamed gets what the replica
    holds and its end, nothing for the tokens between; a streamed one gets each token's progress."""
    assert _messages(streamed=False) == ["holdings", [DoneEvent("abc")]]  # type: ignore[arg-type]
    streamed = _messages(streamed=True)
    assert streamed[-2:] == ["holdings", [DoneEvent("abc")]]  # type: ignore[arg-type]
    assert [batch[-1].completion for batch in streamed[:-2]] == ["a", "ab", "abc"]
