"""The replicated service's log lines in ``hypic serve``'s own output: each ingress and replica
process hands its ``hypic`` log records (and an ingress its access lines) to a queue actor on Ray,
and the ``hypic serve`` process prints them as one server prints its own (Ray's workers write to
files of their own, which nobody watching the service reads)."""
import logging
import os
import sys
import threading
import time
from collections import deque
from typing import Any, TextIO

from ray.util.queue import Empty, Full, Queue

FLUSH_S = 0.2  # how often a process sends its lines on, and the serving process prints them
KEPT_LINES = 10_000  # lines waiting in a process or in the queue at most (more are dropped, counted)
ACCESS = logging.getLogger("hypic.access")


def log_queue(resources: dict[str, float]) -> Queue:
    """The queue the service's processes hand their lines to (on the node ``resources`` name)."""
    return Queue(maxsize=KEPT_LINES, actor_options={"num_cpus": 0, "resources": resources})


class Relay(logging.Handler):
    """A log handler that sends its lines, ``[ROLE pid] LEVEL: message``, to ``queue`` in batches
    from a thread of its own (a caller never waits on Ray)."""

    def __init__(self, queue: Queue, role: str, level: int) -> None:
        super().__init__(level)
        self.queue, self.prefix = queue, f"[{role} {os.getpid()}]"
        self.lines: deque[str] = deque(maxlen=KEPT_LINES)
        self.dropped = 0
        threading.Thread(target=self._send, name="hypic-log-relay", daemon=True).start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{self.prefix} {record.levelname}: {record.getMessage()}")
        except Exception:  # noqa: BLE001 - a line that cannot be formatted is not worth a failure
            self.handleError(record)

    def _send(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            batch = [self.lines.popleft() for _ in range(len(self.lines))]
            if not batch:
                continue
            try:
                self.queue.put_nowait_batch(batch)
            except Full:
                self.dropped += len(batch)
            except Exception:  # noqa: BLE001 - the serving process is gone: nobody to print them
                return


def relay_logs(queue: Queue | None, role: str, level: str) -> None:
    """Send this process's ``hypic`` records at ``level`` and above to ``queue`` (None: nowhere, as
    under a Ray Serve of one's own)."""
    if queue is None:
        return
    relay = Relay(queue, role, logging.getLevelName(level.upper()))
    logger = logging.getLogger("hypic")
    logger.addHandler(relay)
    logger.setLevel(min(logger.getEffectiveLevel(), relay.level))


class AccessLines:
    """An ASGI app that logs a line per HTTP request it serves, as uvicorn's access log writes it
    (``client - "METHOD path HTTP/v" status``), to ``hypic.access`` (Ray Serve turns uvicorn's own
    access logger off in its processes)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = "%s:%d" % tuple(scope["client"]) if scope.get("client") else "-"
            query = f"?{scope['query_string'].decode()}" if scope.get("query_string") else ""
            ACCESS.info('%s - "%s %s%s HTTP/%s" %s', client, scope["method"], scope["path"], query,
                        scope.get("http_version", "1.1"), status[0] if status else "-")


def print_relayed(queue: Queue, stop: threading.Event, out: TextIO = sys.stderr) -> threading.Thread:
    """Print what reaches ``queue`` until ``stop`` (a thread of the serving process)."""

    def drain() -> None:
        while not stop.wait(FLUSH_S):
            try:
                waiting = queue.qsize()
                lines = queue.get_nowait_batch(waiting) if waiting else []
            except Empty:
                continue
            except Exception:  # noqa: BLE001 - Ray went down with the service
                return
            for line in lines:
                print(line, file=out, flush=True)

    thread = threading.Thread(target=drain, name="hypic-log-printer", daemon=True)
    thread.start()
    return thread


__all__ = ["AccessLines", "Relay", "log_queue", "print_relayed", "relay_logs"]
