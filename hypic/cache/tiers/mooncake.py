"""L3, shared: Mooncake Store (``mooncake-transfer-engine``; TCP transport on a CPU server).

Every server on one master puts and gets the same entry files under ``hypic/<namespace>/<digest>``,
so a document one server built is a hit on all. The objects live in the memory segments the
servers contribute (``segment_bytes`` each), managed and evicted by the master. Connecting runs
in the background (Mooncake's client retries for a minute when the master is down), so the engine
never waits on it; once connected, the client finds a restarted master by itself.

An object is read with one zero-copy transfer (``batch_get_into``) into a host buffer registered
with the client (``StagingBuffers``), which the decoder then copies out of once, checking it as it
goes; the buffers are kept for the next read.
"""
import contextlib
import logging
import os
from collections import OrderedDict, deque
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .hierarchy import TierConnecting

PREFIX = "hypic/"
DEFAULT_SEGMENT_BYTES = 1 << 30  # memory this server lends the shared store
DEFAULT_BUFFER_BYTES = 256 << 20  # its transfer buffer
KNOWN_ADDRESSES = 1 << 16  # addresses this server has seen in the store, at most (the scheduler's hint)
OBJECT_NOT_FOUND = -704  # what Mooncake's client answers for a name the store does not hold
STAGING_GRANULE = 16 << 20  # read buffers are registered in multiples of this
IDLE_STAGING = 2  # read buffers kept registered between reads, at most
RETIRED_STAGING = 4  # buffers of failed transfers kept out of use, at most (the oldest is freed: long done)
log = logging.getLogger("hypic.cache.tiers")


class MooncakeUnavailable(ConnectionError):
    """The master cannot be reached, or a call to it failed."""


class MooncakeConnecting(MooncakeUnavailable, TierConnecting):
    """The first connection to the master is under way (it has not failed yet)."""


class StagingBuffers:
    """Host buffers registered with a Mooncake client (its transfer engine writes only into registered
    memory): one per read in progress, grown to fit the object, kept for the next read. Thread-safe
    (reads run on the engine loop and on prefetch threads)."""

    def __init__(self, client) -> None:
        self.client = client
        self.idle: list[torch.Tensor] = []
        self.retired: deque[torch.Tensor] = deque()  # a failed transfer may still write into these: not reused
        self.lock = threading.Lock()

    def take(self, size: int) -> torch.Tensor:
        """A registered buffer of at least ``size`` bytes (raises ``MooncakeUnavailable`` if the client
        refuses to register one)."""
        with self.lock:
            fits = [i for i, b in enumerate(self.idle) if b.numel() >= size]  # by index: tensors compare by value
            buffer = self.idle.pop(min(fits, key=lambda i: self.idle[i].numel())) if fits else None
        return buffer if buffer is not None else self._registered(size)

    def _registered(self, size: int) -> torch.Tensor:
        buffer = torch.empty(-(-max(size, 1) // STAGING_GRANULE) * STAGING_GRANULE, dtype=torch.uint8)
        code = self.client.register_buffer(buffer.data_ptr(), buffer.numel())
        if code != 0:
            raise MooncakeUnavailable(f"register_buffer of {buffer.numel()} bytes failed with code {code}")
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for the next read (the smallest idle one goes if too many are kept)."""
        with self.lock:
            self.idle.append(buffer)
            if len(self.idle) <= IDLE_STAGING:
                return
            dropped = self.idle.pop(min(range(len(self.idle)), key=lambda i: self.idle[i].numel()))
        self.client.unregister_buffer(dropped.data_ptr())

    def retire(self, buffer: torch.Tensor) -> None:
        """``buffer``'s transfer failed: it stays allocated and registered, unused, until
        ``RETIRED_STAGING`` later failures (a transfer that timed out may still be writing into it)."""
        with self.lock:
            self.retired.append(buffer)
            freed = self.retired.popleft() if len(self.retired) > RETIRED_STAGING else None
        if freed is not None:
            self.client.unregister_buffer(freed.data_ptr())

    def describe(self) -> dict:
        with self.lock:
            return {"staging_buffers": len(self.idle), "staging_bytes": sum(b.numel() for b in self.idle),
                    "retired_staging_buffers": len(self.retired)}


class MooncakeTier:
    """Entry files by address in a Mooncake Store; ``open`` connects in the background."""

    name = "mooncake"

    def __init__(self, master: str, metadata_server: str | None = None, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 buffer_bytes: int = DEFAULT_BUFFER_BYTES, local_hostname: str | None = None) -> None:
        host = master.rpartition(":")[0]
        self.master, self.segment_bytes, self.buffer_bytes = master, segment_bytes, buffer_bytes
        self.metadata_server = metadata_server or f"http://{host}:8080/metadata"
        self.local_hostname = local_hostname or _local_address(host)
        self.client = None
        self.staging: StagingBuffers | None = None
        self.staging_lock = threading.Lock()
        self.connecting: threading.Thread | None = None
        self.error = ""
        self.known: OrderedDict[str, None] = OrderedDict()  # put or found here, not seen gone since; LRU
        self.known_lock = threading.Lock()
        self.on_removed: Callable[[str], None] = lambda address: None  # told each address it stops believing held

    def open(self) -> None:
        """Return if connected; else start connecting (once at a time) and raise ``MooncakeConnecting``
        until an attempt has failed, ``MooncakeUnavailable`` with its error after."""
        if self.client is not None:
            return
        if self.connecting is None or not self.connecting.is_alive():
            self.connecting = threading.Thread(target=self._connect, name="hypic-mooncake-connect", daemon=True)
            self.connecting.start()
        if self.error:
            raise MooncakeUnavailable(self.error)
        raise MooncakeConnecting(f"connecting to the Mooncake master {self.master}")

    def _connect(self) -> None:
        """One attempt; its failure stays in ``error`` (the next ``open`` reports it and tries again)."""
        try:
            self.client, self.error = self._setup(), ""
        except Exception as err:  # noqa: BLE001 - reported by open, never raised on this thread
            self.error = f"cannot reach the Mooncake master {self.master} ({type(err).__name__}: {err})"

    def _setup(self):
        os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's client logs every call at INFO otherwise
        from mooncake.store import MooncakeDistributedStore

        client = MooncakeDistributedStore()
        code = client.setup(self.local_hostname, self.metadata_server, self.segment_bytes, self.buffer_bytes,
                            "tcp", "", self.master)
        if code != 0:
            raise ConnectionError(f"setup returned {code}")
        return client

    def _connected(self):
        if self.client is None:
            raise MooncakeUnavailable(self.error or "not connected")
        return self.client

    def _staging(self) -> StagingBuffers:
        client = self._connected()
        with self.staging_lock:
            if self.staging is None or self.staging.client is not client:
                self.staging = StagingBuffers(client)
            return self.staging

    @contextlib.contextmanager
    def reading(self, address: str) -> Iterator[memoryview | None]:
        """The object's bytes, transferred into a registered buffer (None if the store does not hold
        it); valid inside the block only."""
        size = self._connected().get_size(PREFIX + address)
        if size < 0 and size != OBJECT_NOT_FOUND:
            raise MooncakeUnavailable(f"get_size failed with code {size}")
        if size <= 0:
            self._saw(address, False)
            yield None
            return
        staging = self._staging()
        buffer = staging.take(size)
        read = self._get_into(staging, buffer, address, size)
        self._saw(address, read > 0)
        try:
            yield memoryview(buffer.numpy())[:read] if read > 0 else None  # gone since get_size (evicted): a miss
        finally:
            staging.give_back(buffer)

    def _get_into(self, staging: StagingBuffers, buffer: torch.Tensor, address: str, size: int) -> int:
        """Bytes of ``address`` transferred into ``buffer`` (0: gone); a failed transfer retires the buffer."""
        try:
            (read,) = self._connected().batch_get_into([PREFIX + address], [buffer.data_ptr()], [size])
        except BaseException:
            staging.retire(buffer)
            raise
        if read < 0 and read != OBJECT_NOT_FOUND:
            staging.retire(buffer)
            raise MooncakeUnavailable(f"batch_get_into of {size} bytes failed with code {read}")
        return max(read, 0)

    def indexed(self, address: str) -> bool:
        """Whether this server put ``address`` in the store or found it there, and has not seen it gone
        since (no I/O: a hint for the scheduler's estimates; the master or another server may have
        evicted it meanwhile, and what other servers put is unknown until asked)."""
        with self.known_lock:
            return address in self.known

    def _saw(self, address: str, present: bool) -> None:
        """Keep what a call to the store said of ``address`` (the most recent ``KNOWN_ADDRESSES``)."""
        with self.known_lock:
            if not present:
                forgotten = [address] if self.known.pop(address, 0) is None else []
            else:
                self.known[address] = None
                self.known.move_to_end(address)
                forgotten = [self.known.popitem(last=False)[0] for _ in range(len(self.known) - KNOWN_ADDRESSES)]
        for gone in forgotten:
            self.on_removed(gone)

    def contains(self, address: str) -> bool:
        present = self._connected().is_exist(PREFIX + address)
        if present < 0:
            raise MooncakeUnavailable(f"is_exist failed with code {present}")
        self._saw(address, bool(present))
        return bool(present)

    def contains_all(self, addresses: list[str]) -> list[bool]:
        """Which of ``addresses`` the store holds, in one call."""
        answers = self._connected().batch_is_exist([PREFIX + address for address in addresses])
        if len(answers) != len(addresses) or any(answer < 0 for answer in answers):
            raise MooncakeUnavailable(f"batch_is_exist of {len(addresses)} names failed")
        return [bool(answer) for answer in answers]

    def write(self, address: str, data: bytes) -> None:
        code = self._connected().put(PREFIX + address, data)
        if code != 0:
            raise MooncakeUnavailable(f"put of {len(data)} bytes failed with code {code}")
        self._saw(address, True)

    def remove(self, address: str) -> None:
        self._connected().remove(PREFIX + address)  # a leased object stays until its lease ends
        self._saw(address, False)

    def flush(self, namespace_dir: str | None) -> int:
        pattern = f"^{PREFIX}{namespace_dir}/" if namespace_dir is not None else f"^{PREFIX}"
        removed = self._connected().remove_by_regex(pattern)
        if removed < 0:
            raise MooncakeUnavailable(f"remove_by_regex failed with code {removed}")
        with self.known_lock:
            forgotten = [a for a in self.known if namespace_dir is None or a.startswith(f"{namespace_dir}/")]
            for address in forgotten:
                del self.known[address]
        for address in forgotten:
            self.on_removed(address)
        return removed

    def describe(self) -> dict:
        staging = self.staging.describe() if self.staging is not None else {}
        return {"master": self.master, "metadata_server": self.metadata_server, "local_hostname": self.local_hostname,
                "segment_bytes": self.segment_bytes, "connected": self.client is not None,
                "known_entries": len(self.known), **staging}


def _local_address(master_host: str) -> str:
    """The address peers reach this server on: loopback beside a loopback master, else the address
    of the interface that routes to the master."""
    if master_host in ("127.0.0.1", "localhost", "::1", ""):
        return "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_host, 9))
        return probe.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


@dataclass
class MasterProcess:
    """A ``mooncake_master`` child process serving its own metadata over HTTP on loopback."""

    process: subprocess.Popen
    rpc_port: int
    http_port: int

    @property
    def address(self) -> str:
        """What ``--mooncake-master`` takes."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """What ``--mooncake-metadata-server`` takes."""
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_master(log: Path, rpc_port: int, http_port: int, metrics_port: int, lease_ms: int = 10_000,
                 timeout_s: float = 30.0) -> MasterProcess:
    """Start the ``mooncake_master`` of the installed package on loopback (the ports given: the same
    ones again after a restart) and wait until its metadata server answers. ``lease_ms``: how long
    a read object is protected from removal."""
    binary = shutil.which("mooncake_master")
    if binary is None:
        raise FileNotFoundError("mooncake_master is not installed (pip install mooncake-transfer-engine-non-cuda)")
    command = [binary, f"--rpc_port={rpc_port}", "--enable_http_metadata_server=true",
               "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http_port}",
               "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}", f"--default_kv_lease_ttl={lease_ms}"]
    process = subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT)
    master = MasterProcess(process, rpc_port, http_port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with status {process.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", rpc_port), timeout=1):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", http_port), timeout=1):
                return master
        time.sleep(0.1)
    master.stop(signal.SIGKILL)
    raise RuntimeError(f"mooncake_master did not listen in {timeout_s:.0f} s")
