"""Handing freed heap memory back to the system (``hypic.heap``): memory freed below a block
still in use stays resident until ``malloc_trim``; the trimmer runs it at most once per interval."""
import ctypes
import math
from pathlib import Path

import pytest

from hypic import heap
from hypic.errors import HypicError
from hypic.heap import HeapTrimmer, heap_trim_interval, trim_heap

MIB = 2**20


def _vm_rss() -> int:
    """Resident bytes as the kernel reports them in /proc/self/status (VmRSS, KiB)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(heap._malloc_trim() is None, reason="needs glibc's malloc_trim")
def test_memory_freed_below_a_live_block_goes_back_to_the_system() -> None:
    """200 MiB of small C-heap blocks freed while one block allocated after them lives on: free()
    cannot shrink the heap past that block, so the pages stay resident; a trim gives them back."""
    malloc, free = ctypes.CDLL("libc.so.6").malloc, ctypes.CDLL("libc.so.6").free
    malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    blocks = [malloc(4096) for _ in range(50_000)]
    for block in blocks:
        ctypes.memset(block, 1, 4096)  # touched: resident
    pin = malloc(4096)  # above them: the heap's top stays here
    for block in blocks:
        free(block)
    held = _vm_rss()
    released = trim_heap()
    dropped = held - _vm_rss()
    free(pin)
    assert dropped > 150 * MIB  # the kernel's count: the freed pages left
    assert released == pytest.approx(dropped, abs=16 * MIB)  # and the trim reports what it gave back


def test_the_trimmer_trims_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked every second for 100 s with a 30 s interval, it trims at 30, 60 and 90 s."""
    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(now[0]) or 5)
    now = [0.0]
    trimmer = HeapTrimmer(30.0, clock=lambda: now[0])
    for second in range(1, 101):
        now[0] = float(second)
        trimmer.maybe()
    assert calls == [30.0, 60.0, 90.0]
    assert (trimmer.trims, trimmer.released_bytes) == (3, 15)


def test_the_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYPIC_HEAP_TRIM_S", raising=False)
    assert heap_trim_interval() == heap.TRIM_EVERY_S
    monkeypatch.setenv("HYPIC_HEAP_TRIM_S", "2.5")
    assert heap_trim_interval() == 2.5
    monkeypatch.setenv("HYPIC_HEAP_TRIM_S", "0")
    assert heap_trim_interval() == math.inf  # never
    for bad in ("soon", "-1"):
        monkeypatch.setenv("HYPIC_HEAP_TRIM_S", bad)
        with pytest.raises(HypicError, match="HYPIC_HEAP_TRIM_S"):
            heap_trim_interval()


ARENA_COUNT = """
import ctypes, os, sys, tempfile, threading
from hypic.heap import limit_arenas
if sys.argv[1] == "limited":
    limit_arenas(2)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.fdopen.restype, libc.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
libc.malloc_info.argtypes, libc.fflush.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
start = threading.Barrier(8)
def allocate():
    start.wait()  # all at once: each thread takes an arena of its own while there may be more
    libc.malloc(1000)
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
with tempfile.TemporaryFile("w+") as report:  # glibc's own account: one <heap> per arena
    libc.fflush(None)
    libc.malloc_info(0, libc.fdopen(os.dup(report.fileno()), b"w"))
    libc.fflush(None)
    report.seek(0)
    print(report.read().count("<heap nr="), os.environ["MALLOC_ARENA_MAX"] if "MALLOC_ARENA_MAX" in os.environ else "-")
"""


@pytest.mark.skipif(heap.glibc() is None, reason="needs glibc")
@pytest.mark.parametrize(("mode", "env", "most", "exported"), [
    ("limited", None, 2, "2"), ("free", None, None, "-"), ("limited", "3", 3, "3")])
def test_arenas_are_limited_here_and_for_the_processes_started_from_here(
        mode: str, env: str | None, most: int | None, exported: str) -> None:
    """Eight threads allocating at once take an arena each unless the process is limited: with
    ``limit_arenas(2)`` glibc reports at most 2 arenas and ``MALLOC_ARENA_MAX`` is exported for the
    processes this one starts; a value already in the environment wins."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    # a value set after the child started (glibc has read its environment by then): only the call applies it
    script = ARENA_COUNT if env is None else f"import os; os.environ['MALLOC_ARENA_MAX'] = '{env}'\n" + ARENA_COUNT
    out = subprocess.run([sys.executable, "-c", script, mode], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    arenas, exported_value = out.stdout.split()
    assert exported_value == exported
    assert int(arenas) <= most if most is not None else int(arenas) > 2
