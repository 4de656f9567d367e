"""Handing the C allocator's free memory back to the system, now and then.

glibc's malloc keeps what a process frees in its arenas (one per group of threads) and returns it
to the system only from an arena's top. A server whose engine loop, HTTP threads, Ray threads and
peer waits all allocate and free tensors of changing sizes ends up with much of its resident
memory free inside arenas but still held: it creeps up under steady load with no object growing.
``malloc_trim(0)`` gives the free pages of every arena back (a few milliseconds for hundreds of
megabytes), and fewer arenas (``limit_arenas``) hold less free memory between trims. Elsewhere
than glibc this does nothing."""
import ctypes
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from .errors import HypicError, as_written

TRIM_EVERY_S = 30.0  # between trims of a busy process; each costs milliseconds
TRIM_ENV = "HYPIC_HEAP_TRIM_S"
MAX_ARENAS = 2  # malloc arenas of a server and its Ray workers (glibc's default: 8 per core)
ARENAS_ENV = "MALLOC_ARENA_MAX"  # glibc's own variable
M_ARENA_MAX = -8  # mallopt's parameter number for it (malloc.h)
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def heap_trim_interval() -> float:
    """Seconds between trims: ``HYPIC_HEAP_TRIM_S`` (0: never), else ``TRIM_EVERY_S``. An
    environment variable so that the Ray workers a server starts, which inherit it, follow it too."""
    text = os.environ.get(TRIM_ENV, "")
    try:
        seconds = float(text) if text else TRIM_EVERY_S
    except ValueError:
        raise HypicError(f"{TRIM_ENV} must be a number of seconds (0: never), got {as_written(text)}") from None
    if seconds < 0:
        raise HypicError(f"{TRIM_ENV} must be >= 0 (0: never), got {text}")
    return math.inf if seconds == 0 else seconds


def limit_arenas(arenas: int = MAX_ARENAS) -> None:
    """At most ``arenas`` malloc arenas in this process from now on, and in the processes it starts
    (Ray's raylet and workers read ``MALLOC_ARENA_MAX`` when they start); a value already in the
    environment wins. Each arena keeps its own free memory: fewer arenas, less held free."""
    chosen = os.environ.setdefault(ARENAS_ENV, str(arenas))
    libc = glibc()
    if libc is not None and chosen.isdigit() and int(chosen) > 0:
        libc.mallopt(M_ARENA_MAX, int(chosen))


@cache
def glibc() -> ctypes.CDLL | None:
    """glibc, where it has ``malloc_trim`` and ``mallopt`` (None elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def _malloc_trim() -> Callable[[int], int] | None:
    libc = glibc()
    return None if libc is None else libc.malloc_trim


def resident_bytes() -> int:
    """This process's resident memory (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * PAGE_BYTES
    except OSError:
        return 0


def trim_heap() -> int:
    """Give the allocator's free pages back to the system; returns the resident bytes that freed
    (0 where malloc_trim is missing)."""
    trim = _malloc_trim()
    if trim is None:
        return 0
    before = resident_bytes()
    trim(0)
    return max(0, before - resident_bytes())


@dataclass
class HeapTrimmer:
    """``trim_heap`` at most once per ``every_s`` seconds, counted (trims, seconds spent in them,
    resident bytes they gave back)."""

    every_s: float = TRIM_EVERY_S
    clock: Callable[[], float] = time.monotonic
    trims: int = 0
    seconds: float = 0.0
    released_bytes: int = 0

    def __post_init__(self) -> None:
        self.last = self.clock()

    def maybe(self) -> bool:
        """Trim if ``every_s`` has passed since the last trim (or since this trimmer was made)."""
        now = self.clock()
        if now - self.last < self.every_s:
            return False
        started = time.perf_counter()
        self.released_bytes += trim_heap()
        self.seconds += time.perf_counter() - started
        self.trims, self.last = self.trims + 1, self.clock()
        return True

    def as_dict(self) -> dict[str, float]:
        return {"heap_trims": self.trims, "heap_trim_seconds": self.seconds, "heap_trimmed_bytes": self.released_bytes}
