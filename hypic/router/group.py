"""The bulk-transfer group of a worker pool: every live member (the driver's own engine too, when
it is a worker) as one gloo process group, rebuilt among the survivors after a member is lost or
a transfer fails. While no group is live, entries travel through Ray's object store."""
import logging
import time
from typing import Any

import ray

from .channel import JOIN_TIMEOUT_S, BulkChannel, GroupSpec, master_store

log = logging.getLogger("hypic.router")


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

    def rebuild(self, workers: dict[int, Any]) -> None:
        """A new generation over the driver (if a member) and the live ``workers`` (actor handles)."""
        start, members = time.perf_counter(), [*self.local, *sorted(workers)]
        self.generation += 1
        if self.channel is not None:
            self.channel.close()
        self.live, self.needs_rebuild, self.ranks, self.channel = False, False, {}, None
        if len(members) < 2:
            return
        try:
            self._join(members, workers)
        except Exception as err:  # noqa: BLE001 - no group only means the object store carries the entries
            log.warning("bulk-transfer group %d not built (%s: %s); entries go through Ray's object store",
                        self.generation, type(err).__name__, err)
        self.rebuilds += 1
        self.rebuild_s += time.perf_counter() - start

    def _join(self, members: list[int], workers: dict[int, Any]) -> None:
        host = ray.util.get_node_ip_address()
        store = master_store(host, JOIN_TIMEOUT_S)
        spec = GroupSpec(host, store.port, len(members), self.generation, self.timeout_s)
        ranks = {worker: rank for rank, worker in enumerate(members)}
        joins = [workers[w].join_group.remote(spec, ranks[w]) for w in members if w in workers]
        channel = BulkChannel(spec, ranks[self.local[0]]) if self.local else None
        ray.get(joins, timeout=JOIN_TIMEOUT_S)
        self._store, self.channel, self.ranks, self.live = store, channel, ranks, True

    def status(self) -> dict[str, Any]:
        return {"transfer": "torch.distributed (gloo)" if self.live else "ray object store (no live group)",
                "group_generation": self.generation, "group_rebuilds": self.rebuilds,
                "group_rebuild_s": round(self.rebuild_s, 4)}
