"""What other threads hand the engine loop, in order: requests and warm-ups (bounded: past ``max_queued``
waiting, more are refused) and commands run on its thread; closed for good once the loop stopped."""
import queue
import threading
from collections.abc import Iterator

from .jobs import Command, LoopStopped, Pending, QueueFull
from .stats import LoopStats

Item = Pending | Command | None  # None: the loop stops


class Inbox:
    def __init__(self, max_queued: int, stats: LoopStats) -> None:
        self.max_queued, self.stats = max_queued, stats
        self.queue: queue.Queue[Item] = queue.Queue()
        self.queued = 0  # requests and warm-ups taken and not yet gone from the loop
        self.stopped: str | None = None  # why the loop stopped after a fault
        self._lock = threading.Lock()

    def enqueue(self, item: Pending) -> None:
        """Hand over a request or a warm-up; raises ``QueueFull`` past ``max_queued``, ``LoopStopped`` once stopped."""
        with self._lock:
            self._check_open()
            if self.queued >= self.max_queued:
                self.stats.requests_refused += 1
                raise QueueFull(f"the server is at its limit of {self.max_queued} waiting requests "
                                "(--max-queued-requests): try again shortly")
            self.queued += 1
        self.queue.put(item)

    def command(self, command: Command) -> None:
        """Hand over a command; raises ``LoopStopped`` once stopped."""
        with self._lock:
            self._check_open()
        self.queue.put(command)

    def put(self, item: Item) -> None:
        """Hand over anything, unchecked (the loop's own news: a wake-up, a stop)."""
        self.queue.put(item)

    def _check_open(self) -> None:
        if self.stopped is not None:
            raise LoopStopped(self.stopped)

    @property
    def full(self) -> bool:
        return self.queued >= self.max_queued

    def gone(self) -> None:
        """A request or warm-up taken left the loop."""
        with self._lock:
            self.queued -= 1

    def close(self, message: str) -> list[Pending | Command]:
        """The loop stopped (``message``): refuse everything from now on; what was not taken yet."""
        with self._lock:
            self.stopped = message
        return [item for item in self.items(None) if item is not None]

    def items(self, wait_s: float | None) -> Iterator[Item]:
        """What it holds now, waiting up to ``wait_s`` for the first item (None: not at all); ends after
        a None (shutdown)."""
        try:
            item = self.queue.get(timeout=wait_s) if wait_s is not None else self.queue.get_nowait()
            while item is not None:
                yield item
                item = self.queue.get_nowait()
            yield None
        except queue.Empty:
            return
