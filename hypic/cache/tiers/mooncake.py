"""L3, shared: Mooncake Store (``mooncake-transfer-engine``; TCP transport on a CPU server).

Every server on one master puts and gets the same entry files under ``hypic/<namespace>/<digest>``,
so a document one server built is a hit on all. The objects live in the memory segments the
servers contribute (``segment_bytes`` each), managed and evicted by the master. Connecting runs
in the background (Mooncake's client retries for a minute when the master is down), so the engine
never waits on it; once connected, the client finds a restarted master by itself.
"""
import contextlib
import os
from collections import OrderedDict
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .hierarchy import TierConnecting

PREFIX = "hypic/"
DEFAULT_SEGMENT_BYTES = 1 << 30  # memory this server lends the shared store
DEFAULT_BUFFER_BYTES = 256 << 20  # its transfer buffer
KNOWN_ADDRESSES = 1 << 16  # addresses this server has seen in the store, at most (the scheduler's hint)


class MooncakeUnavailable(ConnectionError):
    """The master cannot be reached, or a call to it failed."""


class MooncakeConnecting(MooncakeUnavailable, TierConnecting):
    """The first connection to the master is under way (it has not failed yet)."""


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
        self.connecting: threading.Thread | None = None
        self.error = ""
        self.known: OrderedDict[str, None] = OrderedDict()  # put or found here, not seen gone since; LRU
        self.known_lock = threading.Lock()

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

    @contextlib.contextmanager
    def reading(self, address: str) -> Iterator[bytes | None]:
        data = self._connected().get(PREFIX + address) if self.contains(address) else b""
        self._saw(address, bool(data))
        yield data if data else None  # gone between the two calls (evicted): a miss

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
                self.known.pop(address, None)
                return
            self.known[address] = None
            self.known.move_to_end(address)
            while len(self.known) > KNOWN_ADDRESSES:
                self.known.popitem(last=False)

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
            for address in [a for a in self.known if namespace_dir is None or a.startswith(f"{namespace_dir}/")]:
                del self.known[address]
        return removed

    def describe(self) -> dict:
        return {"master": self.master, "metadata_server": self.metadata_server, "local_hostname": self.local_hostname,
                "segment_bytes": self.segment_bytes, "connected": self.client is not None,
                "known_entries": len(self.known)}


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
