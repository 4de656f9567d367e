"""A diagnostic for memory growth in a long-running process (the server, a Ray worker): with
``HYPIC_MEMORY_TRACE=DIR`` set, a thread writes ``DIR/PID.txt`` every ``HYPIC_MEMORY_TRACE_S``
seconds (default 60): RSS, the C allocator's in-use and free bytes, tensor bytes reachable from
Python, and against the first report the objects by type and the Python allocations by source
line (``tracemalloc``) that grew most. Off unless the variable is set (tracemalloc slows Python
code down)."""
import ctypes
import gc
import os
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

from .heap import glibc, resident_bytes

TOP = 25  # rows per table
FRAMES = 6  # call frames kept per allocation (the line that allocates is rarely the one that holds)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_bytes() -> dict[str, int]:
    """glibc's heap: bytes in use (``uordblks`` + mmapped ``hblkhd``), free inside its arenas
    (``fordblks``: fragmentation when it grows), and the arenas' total ({} off glibc >= 2.33)."""
    libc = glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free_in_arenas": info.fordblks, "arenas": info.arena}


def object_counts() -> Counter:
    """Live objects tracked by the garbage collector, by type name."""
    return Counter(type(obj).__qualname__ for obj in gc.get_objects())


def tensor_bytes() -> int:
    """Bytes of the distinct tensor storages reachable from Python objects the collector tracks."""
    try:
        import torch
    except ImportError:
        return 0
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance: isinstance reads __class__, which some deprecated objects warn on
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class MemoryTrace:
    """The reporting thread of one process; the first report is the baseline of the later ones."""

    def __init__(self, folder: Path, every_s: float) -> None:
        self.path, self.every_s = folder / f"{os.getpid()}.txt", every_s
        self.start = time.monotonic()
        self.baseline: tuple[Counter, tracemalloc.Snapshot] | None = None

    def run(self) -> None:
        while True:
            time.sleep(self.every_s)
            try:
                self.report()
            except Exception as err:  # noqa: BLE001 - a diagnostic must never take its process down
                self._write(f"report failed: {type(err).__name__}: {err}\n")

    def report(self) -> None:
        counts, snapshot = object_counts(), tracemalloc.take_snapshot()
        lines = [f"=== t={time.monotonic() - self.start:.0f}s rss={resident_bytes() / 2**20:.1f}MB "
                 f"malloc={ {k: round(v / 2**20, 1) for k, v in malloc_bytes().items()} } "
                 f"tensors={tensor_bytes() / 2**20:.1f}MB traced={tracemalloc.get_traced_memory()[0] / 2**20:.1f}MB "
                 f"objects={sum(counts.values())}"]
        if self.baseline is None:
            self.baseline = (counts, snapshot)
        else:
            lines += self._growth(counts, snapshot)
        self._write("\n".join(lines) + "\n")

    def _growth(self, counts: Counter, snapshot: tracemalloc.Snapshot) -> list[str]:
        grown = Counter({name: n - self.baseline[0].get(name, 0) for name, n in counts.items()})
        lines = ["-- objects grown since the first report"] + [f"{n:+8d} {name}" for name, n in grown.most_common(TOP)]
        lines.append("-- allocations grown since the first report (by traceback)")
        for stat in snapshot.compare_to(self.baseline[1], "traceback")[:TOP]:
            lines.append(f"{stat.size_diff / 2**10:+10.1f} KiB {stat.count_diff:+7d} blocks")
            lines += [f"      {frame.filename}:{frame.lineno}" for frame in stat.traceback[:FRAMES]]
        return lines

    def _write(self, text: str) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(text)


def start_from_env() -> Any:
    """Start the reporting thread if ``HYPIC_MEMORY_TRACE`` names a folder (once per process)."""
    folder = os.environ.get("HYPIC_MEMORY_TRACE")
    if not folder or tracemalloc.is_tracing():
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    tracemalloc.start(FRAMES)
    trace = MemoryTrace(Path(folder), float(os.environ.get("HYPIC_MEMORY_TRACE_S", "60")))
    threading.Thread(target=trace.run, name="hypic-memory-trace", daemon=True).start()
    return trace
