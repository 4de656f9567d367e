"""The bulk-transfer group of a worker pool: every live member (the driver's own engine too, when
it is a worker) as one gloo process group, rebuilt among the survivors after a member is lost or
a transfer fails. While no group is live, entries travel through Ray's object store."""
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from .channel import JOIN_TIMEOUT_S, BulkChannel, GroupSpec, master_store

log = logging.getLogger("hypic.router")


@dataclass(frozen=True)
class Rebuild:
    """A rebuild under way: its generation, its members (ids, the driver's first) and their handles."""

    generation: int
    members: list[int]
    workers: dict[int, Any]
    started: float  # time.perf_counter


@dataclass(frozen=True)
class Joined:
    """A group every member joined: its rendezvous store (kept alive with it), the driver's end, the ranks."""

    store: Any
    channel: BulkChannel | None
    ranks: dict[int, int]


class BulkGroup:
    """Ranks and generation of the current group; ``local``: the driver's id if it is a member."""

    def __init__(self, local: tuple[int, ...], timeout_s: float) -> None:
        self.local, self.timeout_s = local, timeout_s
        self.channel: BulkChannel | None = None  # the driver's end (when it is a member)
        self.ranks: dict[int, int] = {}
        self.generation, self.rebuilds, self.rebuild_s = 0, 0, 0.0
        self.live, self.needs_rebuild = False, True
        self._store: Any = None  # the rendezvous store this process hosts (kept alive with the group)

    def destination(self, worker: int) -> tuple[int, int] | None:
        """(rank, generation) entries for ``worker`` go to, or None (use the object store)."""
        if not self.live or worker not in self.ranks:
            return None
        return self.ranks[worker], self.generation

    def mark_broken(self) -> None:
        """A transfer failed: stop using this group; the pool rebuilds it after the request."""
        self.live, self.needs_rebuild = False, True

    def begin(self, workers: dict[int, Any]) -> Rebuild:
        """A rebuild's first step, bookkeeping only: the next generation numbered, the old group given
        up (entries go through the object store until ``adopt``). Returns what ``join`` needs. A
        caller that shares the group between threads runs ``join``, the slow step, outside its lock."""
        self.generation += 1
        if self.channel is not None:
            self.channel.close()
        self.live, self.needs_rebuild, self.ranks, self.channel = False, False, {}, None
        return Rebuild(self.generation, [*self.local, *sorted(workers)], dict(workers), time.perf_counter())

    def join(self, rebuild: Rebuild) -> Joined | None:
        """The slow part (every member joins, ``JOIN_TIMEOUT_S`` at most); touches none of this
        group's state. None: fewer than two members, or the join failed (logged)."""
        if len(rebuild.members) < 2:
            return None
        try:
            return self._join(rebuild)
        except Exception as err:  # noqa: BLE001 - no group only means the object store carries the entries
            log.warning("bulk-transfer group %d not built (%s: %s); entries go through Ray's object store",
                        rebuild.generation, type(err).__name__, err)
            return None

    def adopt(self, rebuild: Rebuild, joined: Joined | None) -> None:
        """Bookkeeping only: the joined group goes live, unless a newer generation began or a
        failure marked the group broken while it joined (then it is dropped, to be rebuilt)."""
        current = rebuild.generation == self.generation and not self.needs_rebuild
        if joined is not None and current:
            self._store, self.channel, self.ranks, self.live = joined.store, joined.channel, joined.ranks, True
        elif joined is not None and joined.channel is not None:
            joined.channel.close()
        if len(rebuild.members) >= 2:
            self.rebuilds += 1
            self.rebuild_s += time.perf_counter() - rebuild.started

    def _join(self, rebuild: Rebuild) -> Joined:
        members, workers = rebuild.members, rebuild.workers
        host = ray.util.get_node_ip_address()
        store = master_store(host, JOIN_TIMEOUT_S)
        spec = GroupSpec(host, store.port, len(members), rebuild.generation, self.timeout_s)
        ranks = {worker: rank for rank, worker in enumerate(members)}
        joins = [workers[w].join_group.remote(spec, ranks[w]) for w in members if w in workers]
        channel = BulkChannel(spec, ranks[self.local[0]]) if self.local else None
        ray.get(joins, timeout=JOIN_TIMEOUT_S)
        return Joined(store, channel, ranks)

    def status(self) -> dict[str, Any]:
        return {"transfer": "torch.distributed (gloo)" if self.live else "ray object store (no live group)",
                "group_generation": self.generation, "group_rebuilds": self.rebuilds,
                "group_rebuild_s": round(self.rebuild_s, 4)}
