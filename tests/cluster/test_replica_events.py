"""What a replica sends of its request's events: a batch's progress coalesced to each sample's
latest (the ingress sends its client what is new since the last chunk), nothing but the end for a
request that is not streamed. Expected lists worked out by hand."""
from hypic.cluster.replica import told
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
