"""The engine loop's scheduling policy: in what order waiting work runs, how much of it is left after
a pass, and whether one more request may start. Decisions over plain numbers; the loop does what
they say (``EngineLoop``)."""
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

WAIT_CREDIT_TOKENS_PER_S = 256.0  # a request that has waited t seconds longer ranks as 256 t tokens smaller
URGENT = -math.inf  # the rank of work that goes before any build (a worker's combine passes)


class Ranked(Protocol):
    remaining: float  # about how many tokens its work still computes
    start: float  # when it arrived (``time.perf_counter``)


P = TypeVar("P", bound=Ranked)


@dataclass(frozen=True)
class SchedulingPolicy:
    """Fewest tokens left first, less a credit for the time waited (a long cold request neither holds up
    short ones nor starves behind them); a request starts while a running slot is free and its state
    fits ``max_state_bytes`` beside what running and starting requests may hold (None: no bound)."""

    max_running: int = 64
    max_state_bytes: int | None = None
    wait_credit: float = WAIT_CREDIT_TOKENS_PER_S

    def rank(self, item: Ranked) -> float:
        """Smaller runs first: tokens left less ``wait_credit`` per second waited. Waiting is measured from
        each item's arrival, so the ranking needs no clock: every item has waited until the same now."""
        return item.remaining + self.wait_credit * item.start

    def order(self, waiting: Iterable[P]) -> list[P]:
        return sorted(waiting, key=self.rank)

    @staticmethod
    def left(remaining: float, done: int) -> float:
        """Tokens left after a pass of ``done`` tokens: at least 1 (0 or ``URGENT`` stay as they are)."""
        return remaining if remaining < 1 else max(1, remaining - done)

    def admits(self, slots_taken: int, bytes_held: int, footprint: int) -> bool:
        """Whether a request whose state may take ``footprint`` bytes starts beside ``slots_taken`` running
        or starting requests that may hold ``bytes_held``."""
        return slots_taken < self.max_running and self.ever_fits(bytes_held + footprint)

    def ever_fits(self, footprint: int) -> bool:
        """Whether ``footprint`` bytes of state fit ``max_state_bytes`` (alone: whether a request could ever start)."""
        return self.max_state_bytes is None or footprint <= self.max_state_bytes
