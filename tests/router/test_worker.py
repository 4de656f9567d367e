"""A worker hosts the server's engine loop (``EngineLoop``): its builds and combine passes run there in
chunks, in priority order (fewest uncached tokens first; combine passes and control work before any
build), so one request's short documents are not held up by another's long one."""
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.router.plan import SegmentJob
from hypic.router.plan import PROMPT_ORDER_TOKENS
from hypic.planner import Planner
from hypic.router.plan import document_jobs
from hypic.router.worker import Worker
from hypic.scheduler.loop import URGENT, EngineLoop, WarmupTask

CHUNK = 32


@pytest.fixture(scope="module")
def worker(tiny_checkpoint: Path) -> Iterator[Worker]:
    worker = Worker(str(tiny_checkpoint), options={"chunk_tokens": CHUNK, "dtype": "float32"})
    yield worker
    worker.loop.stop()


def _job(tiny_checkpoint: Path, text: str) -> SegmentJob:
    planner = Planner.for_model(tiny_checkpoint)
    (job,) = document_jobs(planner.plan(planner.parse(f"q{SEP}{text}{SEP}?")))
    return job


def _building(loop: EngineLoop) -> bool:
    """Whether a build is under way (a task that has asked for a combine pass)."""
    return any(isinstance(p, WarmupTask) and p.work is not None for p in list(loop.waiting))


def test_a_short_build_overtakes_a_long_one_between_its_chunks(worker: Worker, tiny_checkpoint: Path) -> None:
    """A 2,400-token document is built in 32-token chunks; a 60-token document asked for meanwhile (fewer
    uncached tokens) is built and returned while the long one is still going, and both entries are
    those an engine of its own builds (a build never sees the other's chunks)."""
    long_job, short_job = _job(tiny_checkpoint, "long " * 480), _job(tiny_checkpoint, "short doc " * 6)
    done: list[str] = []
    builder = threading.Thread(target=lambda: (worker.build([long_job], "hypic", 2400), done.append("long")))
    builder.start()
    deadline = time.monotonic() + 30
    while not _building(worker.loop) and time.monotonic() < deadline:
        time.sleep(0.005)
    (short,) = worker.build([short_job], "hypic", len(short_job.token_ids))
    assert done == [], "the short build waited for the long one"
    builder.join()
    (long,) = worker.build([long_job], "hypic", 0)  # held now: the entry built under the short one's passes
    alone = Engine.from_pretrained(tiny_checkpoint, dtype="float32", chunk_tokens=CHUNK)
    for job, entry in ((long_job, long), (short_job, short)):
        expected = alone.segment_entry(job.token_ids, alone.policy("hypic"))[0]
        for ours, theirs in zip(entry.layers, expected.layers):
            for a, b in zip(vars(ours).values(), vars(theirs).values()):
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a, b)


def _order(loop: EngineLoop, priorities: list[float]) -> list[int]:
    """Hold the loop with a command, queue one task per priority (in list order), let go: the run order."""
    started, release, done = threading.Event(), threading.Event(), []

    def record(index: int):  # a task that asks for no combine pass: it ends at its first turn
        done.append(index)
        return index
        yield

    blocker = loop.call(lambda: (started.set(), release.wait()))
    started.wait()
    futures = [loop.run_steps(record(index), priority) for index, priority in enumerate(priorities)]
    release.set()
    blocker.result()
    assert [f.result() for f in futures] == list(range(len(priorities)))
    return done


def test_fewer_uncached_tokens_first_and_combine_passes_before_builds(worker: Worker) -> None:
    assert _order(worker.loop, [3000, 100, URGENT, 2000]) == [2, 1, 3, 0]


def test_a_requests_builds_run_in_prompt_order_whatever_order_they_were_queued_in(worker: Worker) -> None:
    assert _order(worker.loop, [2400 + rank * PROMPT_ORDER_TOKENS for rank in (3, 1, 0, 2)]) == [2, 1, 3, 0]


def test_an_error_reaches_its_caller_only(worker: Worker) -> None:
    def broken():
        raise ZeroDivisionError
        yield

    with pytest.raises(ZeroDivisionError):
        worker.loop.run_steps(broken(), 0).result()
    assert worker.held() is not None
