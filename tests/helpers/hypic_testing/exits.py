"""Waiting for a server process that should end by itself (its engine or its ranks cannot go on)."""
import time
from typing import Any


def exits_within(server: Any, seconds: float, start: float | None = None) -> None:
    """``server`` (a ``ServerProcess``) exits non-zero within ``seconds`` of ``start`` (``time.monotonic``;
    default now); one still running then is stopped, and the check fails."""
    start = time.monotonic() if start is None else start
    try:
        server.process.wait(timeout=max(0.1, seconds - (time.monotonic() - start)))
    finally:
        if server.process.poll() is None:
            server.stop()
    assert server.process.returncode not in (None, 0)
