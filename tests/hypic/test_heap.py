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
