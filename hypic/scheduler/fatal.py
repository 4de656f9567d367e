"""Ending a server whose engine cannot go on: say why, let ``/health`` answer 503 and the clients read
their errors for a moment, then exit non-zero (no graceful stop: a thread may be stuck for good)."""
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

log = logging.getLogger("hypic.server")
EXIT_GRACE_S = 1.0  # how long /health reports the failure before the process exits
EXIT_CODE = 3  # the server's exit status when its engine cannot go on


def _nothing() -> None:
    """Nothing to end before exiting."""


def exit_soon(message: str, before_exit: Callable[[], None] = _nothing) -> None:
    """Log and print ``message``, then, after ``EXIT_GRACE_S``, run ``before_exit`` and exit with ``EXIT_CODE``."""
    log.error("%s: the server stops", message)
    print(f"hypic: error: {message}: the server stops", file=sys.stderr, flush=True)
    threading.Thread(target=_exit_after_grace, args=(before_exit,), name="hypic-fatal-exit", daemon=True).start()


def _exit_after_grace(before_exit: Callable[[], None]) -> None:
    time.sleep(EXIT_GRACE_S)
    try:
        before_exit()
    finally:
        sys.stdout.flush()
        os._exit(EXIT_CODE)
