"""Point-to-point bulk transfer of segment entries over ``torch.distributed`` (gloo) between the
members of one process group. The sender posts its buffer at once and hands back a ``Parcel`` (the
header, through Ray); the receiver checks the header against the model, allocates the buffer the
header describes and receives into it.

A gloo group does not survive a member's death, and a receive that times out closes its pair; so a
failed transfer marks the channel broken (the caller recomputes what did not arrive) and the pool
rebuilds the group among the live members before the next request (``WorkerPool.rebuild_group_if_needed``).
Each group has a generation; a parcel from another generation is refused, never misread."""
import datetime
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from hypic.cache.store import SegmentEntry

from .bulk import buffer_bytes, header_of, pack, unpack


JOIN_TIMEOUT_S = 60.0  # longest wait for every member to join a new group


@dataclass(frozen=True)
class GroupSpec:
    """Where a group's store is and who is in it: ``world`` ranks of generation ``generation``."""

    host: str
    port: int
    world: int
    generation: int
    timeout_s: float


@dataclass(frozen=True)
class Parcel:
    """An entry in flight: its header (``bulk.header_of``) and where its bytes come from."""

    header: SegmentEntry
    source: int  # the sender's rank
    tag: int
    generation: int


class ChannelError(RuntimeError):
    """A transfer did not complete (timeout, lost member, other generation)."""


def master_store(host: str, timeout_s: float) -> TCPStore:
    """A group's rendezvous store, hosted by this process on a free port (keep it alive)."""
    return TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s))


class BulkChannel:
    """This process's end of one group (rank ``rank``). Thread-safe: tags are unique per sender."""

    def __init__(self, spec: GroupSpec, rank: int) -> None:
        joining = datetime.timedelta(seconds=max(spec.timeout_s, JOIN_TIMEOUT_S))  # each receive waits timeout_s
        store = TCPStore(spec.host, spec.port, None, False, timeout=joining)
        self.group = ProcessGroupGloo(PrefixStore(f"hypic-bulk-{spec.generation}", store), rank, spec.world, joining)
        self.spec, self.rank, self.broken = spec, rank, False
        self._tags = itertools.count(1)
        self._outbox: queue.Queue = queue.Queue()  # (work, buffer kept alive until it is sent)
        self._in_flight = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._complete_sends, name=f"hypic-bulk-sends-{spec.generation}", daemon=True).start()

    @property
    def generation(self) -> int:
        return self.spec.generation

    def send(self, entry: SegmentEntry, destination: int) -> Parcel:
        """Post ``entry``'s bytes to rank ``destination``; returns the parcel to hand it. Raises
        ``ChannelError`` (and the channel is broken) if the pair to ``destination`` is closed."""
        tag, flat = next(self._tags), pack(entry)
        try:
            work = self.group.send([flat], destination, tag)
        except RuntimeError as err:  # the pair to ``destination`` is closed (a peer died or timed out)
            self.broken = True
            raise ChannelError(f"send to rank {destination} failed: {err}") from err
        with self._lock:
            self._in_flight += 1
        self._outbox.put((work, flat))
        return Parcel(header_of(entry), self.rank, tag, self.generation)

    def ship(self, entries: list[SegmentEntry], destination: int) -> list[SegmentEntry | Parcel]:
        """Each entry sent to ``destination`` (its parcel), or the entry itself where the pair is closed
        (Ray's object store then carries it, and the channel is broken)."""
        shipped: list[SegmentEntry | Parcel] = []
        for entry in entries:
            try:
                shipped.append(self.send(entry, destination))
            except ChannelError:
                shipped.append(entry)
        return shipped

    def receive(self, parcel: Parcel, check: Callable[[SegmentEntry], None]) -> SegmentEntry:
        """The parcel's entry, ``check``-ed on its header first (a refused header's bytes are
        drained, so the pair stays usable). Raises ``ChannelError`` if the bytes do not arrive within
        the group's timeout (the channel is then broken) or ``check``'s error."""
        if parcel.generation != self.generation:
            raise ChannelError(f"parcel of group generation {parcel.generation}, this channel is {self.generation}")
        buffer = torch.empty(buffer_bytes(parcel.header), dtype=torch.uint8)
        try:
            check(parcel.header)
        except Exception:
            self._receive_into(buffer, parcel)
            raise
        self._receive_into(buffer, parcel)
        return unpack(parcel.header, buffer)

    def _receive_into(self, buffer: torch.Tensor, parcel: Parcel) -> None:
        if self.broken:
            raise ChannelError("the channel is broken; waiting for the group to be rebuilt")
        try:
            self.group.recv([buffer], parcel.source, parcel.tag).wait(datetime.timedelta(seconds=self.spec.timeout_s))
        except RuntimeError as err:
            self.broken = True
            raise ChannelError(f"receive from rank {parcel.source} failed: {err}") from err

    def _complete_sends(self) -> None:
        """Wait for each send in turn (gloo marks a send complete only when waited on), then let its
        buffer go; one the receiver never takes within the timeout breaks the channel."""
        while (item := self._outbox.get()) is not None:
            try:
                item[0].wait(datetime.timedelta(seconds=self.spec.timeout_s))
            except RuntimeError:
                self.broken = True
            with self._lock:
                self._in_flight -= 1

    @property
    def sends_in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def close(self) -> None:
        """Stop the send-completion thread once the sends before this call are done or timed out."""
        self._outbox.put(None)

