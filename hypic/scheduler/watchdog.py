"""The engine loop's deadline per turn. A turn that never ends (a kernel that hangs, a collective whose
peer never comes, a lock never released) would leave every client waiting while the process looks
alive; the watchdog notices the loop has not finished a turn for ``timeout_s`` and says so, once."""
import threading
import time
from collections.abc import Callable


class Watchdog:
    """The loop calls ``beat()`` after every turn; ``overdue()`` names a loop whose last beat is more than
    ``timeout_s`` old (None: no deadline). An idle loop beats every ``EngineLoop.idle_tick_s``, so
    only a turn's work counts against the deadline."""

    def __init__(self, timeout_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"the watchdog's timeout must be positive (or None for no watchdog), not {timeout_s}")
        self.timeout_s, self.clock = timeout_s, clock
        self.last_beat = clock()

    def beat(self) -> None:
        self.last_beat = self.clock()

    def since_beat(self) -> float:
        return self.clock() - self.last_beat

    def overdue(self) -> str | None:
        """Why the loop is overdue, or None while it is within its deadline."""
        quiet = self.since_beat()
        if self.timeout_s is None or quiet <= self.timeout_s:
            return None
        return (f"the engine loop has been inside one turn for {quiet:.1f} s, past the watchdog's "
                f"{self.timeout_s:g} s (--watchdog-timeout): a step hangs")

    def watch(self, on_overdue: Callable[[str], None], watching: Callable[[], bool]) -> None:
        """On a daemon thread, while ``watching()``: tell ``on_overdue`` once the loop is overdue, then stop."""
        if self.timeout_s is not None:
            poll_s = min(1.0, self.timeout_s / 4)
            threading.Thread(target=self._watch, args=(on_overdue, watching, poll_s), name="hypic-watchdog",
                             daemon=True).start()

    def _watch(self, on_overdue: Callable[[str], None], watching: Callable[[], bool], poll_s: float) -> None:
        while watching():
            time.sleep(poll_s)
            message = self.overdue()
            if message is not None and watching():
                on_overdue(message)
                return
