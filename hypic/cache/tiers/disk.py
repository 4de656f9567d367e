"""L3, local: entry files in a directory that outlives the server, under a byte budget (LRU by file).

Files are written under a temporary name and renamed into place, so a reader (this server, a
restarted one, another one on the same directory) sees a whole file or none; two writers of one
address leave one whole file. Recency survives restarts as the files' modification times.
"""
import contextlib
import mmap
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

SUFFIX = ".safetensors"
STALE_TEMP_S = 600.0  # a temporary file this old is a write that died with its server
MAX_HEADER = 1 << 24  # a header longer than this is not one of ours (a start-up scan reads no more)


class DiskTier:
    """Whole files by address under ``directory/hypic-entries``; thread-safe (the engine reads,
    a background writer writes)."""

    name = "disk"

    def __init__(self, directory: str | Path, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.directory, self.budget_bytes = Path(directory), budget_bytes
        self.root = self.directory / "hypic-entries"
        self.files: OrderedDict[str, int] = OrderedDict()  # address -> bytes, least recently used first
        self.lock = threading.Lock()
        self.evictions = self.held_bytes = 0
        self.on_removed: Callable[[str], None] = lambda address: None  # told each address the index lets go

    def open(self) -> None:
        """Create the directory and index the files already there (raises OSError if it cannot)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def path(self, address: str) -> Path:
        """``root/<namespace>/<2 hex>/<digest>.safetensors`` for address ``<namespace>/<digest>``."""
        namespace, _, digest = address.partition("/")
        return self.root / namespace / digest[:2] / f"{digest}{SUFFIX}"

    def _files(self, namespace_dir: str = "*") -> Iterator[tuple[str, Path]]:
        """(address, path) of the entry files (and temporary files) on disk."""
        for path in self.root.glob(f"{namespace_dir}/*/*{SUFFIX}*"):
            yield f"{path.parent.parent.name}/{path.name.partition(SUFFIX)[0]}", path

    def _scan(self) -> None:
        found = []
        for address, path in self._files():
            with contextlib.suppress(OSError):
                stat = path.stat()
                if path.name.endswith(SUFFIX):
                    found.append((stat.st_mtime, address, stat.st_size))
                elif time.time() - stat.st_mtime > STALE_TEMP_S:
                    path.unlink()
        with self.lock:
            for _, address, size in sorted(found):
                self._index(address, size)

    def _index(self, address: str, size: int) -> None:
        """Record ``address`` as most recently used (call with the lock held)."""
        self.held_bytes += size - self.files.pop(address, 0)
        self.files[address] = size

    def _unindex(self, address: str) -> bool:
        """Drop ``address`` from the index (call with the lock held); whether it was there."""
        size = self.files.pop(address, None)
        self.held_bytes -= size or 0
        return size is not None

    @contextlib.contextmanager
    def reading(self, address: str) -> Iterator[memoryview | None]:
        """The file's bytes, memory-mapped (None if it is not there); valid inside the block only."""
        try:
            handle = self.path(address).open("rb")
        except FileNotFoundError:
            with self.lock:
                known = self._unindex(address)  # another server's eviction or a flush
            if known:
                self.on_removed(address)
            yield None
            return
        with handle, _mapped(handle) as view:
            self._touch(address, len(view))
            yield view

    def _touch(self, address: str, size: int) -> None:
        with self.lock:
            self._index(address, size)
        with contextlib.suppress(OSError):
            os.utime(self.path(address))

    def contains(self, address: str) -> bool:
        return self.path(address).exists()

    def touch(self, address: str) -> bool:
        """Mark an indexed file most recently used (a newer resume point refers to it); False if the
        index does not hold it."""
        with self.lock:
            size = self.files.get(address)
        if size is None:
            return False
        self._touch(address, size)
        return True

    def head(self, address: str) -> bytes | None:
        """The first bytes of ``address``'s file: its length field and header (None: not there), read
        without touching its recency (what a start-up scan lists)."""
        try:
            with self.path(address).open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                return size.to_bytes(8, "little") + handle.read(min(size, MAX_HEADER))
        except OSError:
            return None

    def addresses(self) -> list[str]:
        """Every address the index holds (files found at start-up and written since)."""
        with self.lock:
            return list(self.files)

    def indexed(self, address: str) -> bool:
        """Whether the index of files holds ``address`` (no disk access: an estimate's answer)."""
        with self.lock:
            return address in self.files

    def write(self, address: str, data: bytes) -> None:
        """Store ``data`` as ``address`` (then evict the least recently used files over budget);
        raises OSError (disk full, directory gone) leaving no partial file behind."""
        if self.budget_bytes is not None and len(data) > self.budget_bytes:
            return
        path = self.path(address)
        temp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with temp.open("wb") as handle:
                handle.write(data)
            os.replace(temp, path)
        finally:
            with contextlib.suppress(OSError):
                temp.unlink()
        self._touch(address, len(data))
        self._evict()

    def _evict(self) -> None:
        while True:
            with self.lock:
                if self.budget_bytes is None or self.held_bytes <= self.budget_bytes or not self.files:
                    return
                address = next(iter(self.files))
                self._unindex(address)
                self.evictions += 1
            with contextlib.suppress(OSError):
                self.path(address).unlink()
            self.on_removed(address)

    def remove(self, address: str) -> None:
        with self.lock:
            known = self._unindex(address)
        with contextlib.suppress(OSError):
            self.path(address).unlink()
        if known:
            self.on_removed(address)

    def flush(self, namespace_dir: str | None) -> int:
        """Delete every file (of one namespace's directory, if given), this server's or not; returns
        how many documents' entries were among them (the private pool's resume points, heads named
        ``r<hash>`` and KV chunks ``k<hash>``, go too, uncounted)."""
        dropped = 0
        for address, path in list(self._files(namespace_dir or "*")):
            if path.name.endswith(SUFFIX):
                self.remove(address)
                dropped += path.name[0] not in "rk"  # a document's name is a hex digest
        return dropped

    def describe(self) -> dict:
        with self.lock:
            return {"directory": str(self.directory), "budget_bytes": self.budget_bytes,
                    "bytes": self.held_bytes, "entries": len(self.files), "evictions": self.evictions}


@contextlib.contextmanager
def _mapped(handle) -> Iterator[memoryview]:
    size = os.fstat(handle.fileno()).st_size
    if size == 0:
        yield memoryview(b"")
        return
    mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ)
    mapped.madvise(mmap.MADV_WILLNEED)  # a file not in the page cache is read ahead whole, not page by page
    view = memoryview(mapped)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # a view still held (an exception's frames): unmapped when it goes
            view.release()
            mapped.close()
