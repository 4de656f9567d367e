"""A worker's queue: one compute thread runs its engine work in priority order (the fewest
uncached tokens first, less a credit for waiting, as the server's engine loop does)."""
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hypic.server.loop import WAIT_CREDIT_TOKENS_PER_S

URGENT = -math.inf  # control work (checks, installs, lookups, combine passes) before any build
# a request's builds on one worker carry its priority plus this per place in prompt order: they run
# in that order (what the combine node combines early) whatever order Ray's threads queue them in,
# up to 0.25 s of wait-credit jitter
PROMPT_ORDER_TOKENS = 64.0
Result = TypeVar("Result")


@dataclass
class _Task:
    run: Callable[[], Any]
    priority: float  # tokens of work the request still needs (smaller runs first)
    start: float
    future: Future = field(default_factory=Future)


class WorkQueue:
    """``run`` from any thread; the work itself happens on the queue's one thread, in order of
    priority - ``WAIT_CREDIT_TOKENS_PER_S`` x seconds waited (ties: first come)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._tasks, self._ready = clock, [], threading.Condition()
        threading.Thread(target=self._serve, name="hypic-worker-queue", daemon=True).start()

    def run(self, work: Callable[[], Result], priority: float = URGENT) -> Result:
        """Queue ``work`` and wait for its result (its exception is raised here)."""
        task = _Task(work, priority, self._clock())
        with self._ready:
            self._tasks.append(task)
            self._ready.notify()
        return task.future.result()

    def _next(self) -> _Task:
        with self._ready:
            while not self._tasks:
                self._ready.wait()
            now = self._clock()
            task = min(self._tasks, key=lambda t: t.priority - WAIT_CREDIT_TOKENS_PER_S * (now - t.start))
            self._tasks.remove(task)
            return task

    def _serve(self) -> None:
        while True:
            task = self._next()
            try:
                task.future.set_result(task.run())
            except Exception as err:  # handed to the caller
                task.future.set_exception(err)
