"""How the engine loop keeps in step with other loops: where each turn's work comes from, and the
points where loops could part (each pass through the model, each failure and sampled token, each
request taken in or let go, what it reads from outside: cancellations, reads below memory it holds
requests back for). ``Solo`` is a loop that runs alone, its work from its own inbox;
tensor-parallel ranks use ``lockstep.LeaderSync`` and ``lockstep.FollowerSync``, which take each
turn's work from rank 0 and agree on each point with the others. The loop calls these; they never
reach inside it, only its turn-taking methods (``drain``, ``idle_wait``, ``admit``, ``iterate``)."""
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .jobs import Job, Pending

if TYPE_CHECKING:
    from .loop import EngineLoop


class Solo:
    def turn(self, loop: "EngineLoop") -> bool:
        """One turn of ``loop``: drain its inbox (waiting for news when idle), then one iteration;
        False once stopped."""
        if not loop.drain(loop.idle_wait()):
            return False
        loop.iterate()
        return True

    def failure(self) -> str | None:
        """Why the loop's peers can no longer go on with it (None: they can, or it has none)."""
        return None

    def sample_seed(self) -> int | None:
        """The seed an unseeded request's samples draw from (None: torch's generator)."""
        return None

    def before_end(self, err: BaseException) -> None:
        """The loop is about to end because of ``err`` (a rank's failure waits for its cause's name)."""

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
