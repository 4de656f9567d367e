"""How the engine loop keeps in step with other loops at the points where they could part: each pass
through the model, each failure and sampled token, each request it takes in or lets go, and what it
reads from outside (cancellations, reads below memory it holds requests back for). ``Solo`` is a loop
that runs alone; tensor-parallel ranks use ``lockstep.RankSync``, which agrees on each with the others."""
import time
from collections.abc import Callable
from typing import Any

from .jobs import Job, Pending


class Solo:
    def model_call(self, run: Callable[[], Any], batch: list[int]) -> Any:
        """``run()``, one pass through the model over ``batch`` (serials and sizes, in order)."""
        return run()

    def failed(self) -> None:
        """A request, a warm-up or a flush failed."""

    def sampled(self, serial: int, index: int, token: int) -> None:
        """Sample ``index`` of request ``serial`` took ``token``."""

    def admitted(self, item: Pending) -> None:
        """The loop took ``item`` in (numbered)."""

    def left(self, item: Pending) -> None:
        """``item`` left the waiting list."""

    def cancelled(self, pending: Pending) -> bool:
        """Whether ``pending`` is dropped now (its client went away)."""
        return pending.cancelled.is_set()

    def held_back(self, job: Job) -> bool:
        """Whether ``job`` still waits, before it starts, for what it reads below memory: its documents as
        long as the prefetch policy says, its resume point ``resume.LOOKUP_WAIT_S`` at most (then it
        starts, and its prefill takes what is in, as without the wait)."""
        return bool(job.holds(time.monotonic()))
