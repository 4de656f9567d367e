"""A worker's work queue: fewer uncached tokens first, control work before builds, waiting earns
credit (256 tokens a second, as in the server's loop), one thread runs everything."""
import threading
import time

import pytest

from hypic.router.work_queue import PROMPT_ORDER_TOKENS, URGENT, WorkQueue


def _order(queue: WorkQueue, priorities: list[float]) -> list[int]:
    """Queue a blocker, then one task per priority (in list order); release; the run order."""
    release, started, done = threading.Event(), threading.Event(), []
    blocker = threading.Thread(target=queue.run, args=(lambda: (started.set(), release.wait()),))
    blocker.start()
    started.wait()
    threads = []
    for index, priority in enumerate(priorities):
        threads.append(threading.Thread(target=queue.run, args=(lambda i=index: done.append(i), priority)))
        threads[-1].start()
        time.sleep(0.02)  # queued in list order
    release.set()
    for thread in [blocker, *threads]:
        thread.join()
    return done


def test_fewer_uncached_tokens_first_and_control_work_before_builds() -> None:
    assert _order(WorkQueue(), [3000, 100, URGENT, 2000]) == [2, 1, 3, 0]


def test_a_requests_builds_run_in_prompt_order_whatever_order_they_were_queued_in() -> None:
    """Ray's threads may queue one request's builds out of order (here 20 ms apart, 5 tokens of
    credit each): their places in the prompt decide."""
    assert _order(WorkQueue(), [2400 + rank * PROMPT_ORDER_TOKENS for rank in (3, 1, 0, 2)]) == [2, 1, 3, 0]


def test_waiting_earns_credit() -> None:
    """With a clock that says the first task has waited 10 s, its 3000 tokens count as 440."""
    now = [0.0]
    queue = WorkQueue(clock=lambda: now[0])
    release, started, done = threading.Event(), threading.Event(), []
    blocker = threading.Thread(target=queue.run, args=(lambda: (started.set(), release.wait()),))
    blocker.start()
    started.wait()
    old = threading.Thread(target=queue.run, args=(lambda: done.append("old"), 3000))
    old.start()
    time.sleep(0.02)
    now[0] = 10.0
    young = threading.Thread(target=queue.run, args=(lambda: done.append("young"), 500))
    young.start()
    time.sleep(0.02)
    release.set()
    for thread in (blocker, old, young):
        thread.join()
    assert done == ["old", "young"]


def test_an_error_reaches_its_caller_only() -> None:
    queue = WorkQueue()
    with pytest.raises(ZeroDivisionError):
        queue.run(lambda: 1 / 0)
    assert queue.run(lambda: 7) == 7
