"""Hot documents copied ahead of need: a document many recent requests named, whose only copy in
memory sits on a replica far busier than another, is copied to the least busy replica with room,
so requests for it are not all served (or fed) by one queue. Pure bookkeeping at the ingress: what
was asked, and which copies to make; the ingress makes them (``ReplicaLoop``)."""
import time
from dataclasses import dataclass, field

from hypic.router.lpt import least_queued

from .index import DocumentIndex, Tier
from .routing import ReplicaLoad, RouteRequest

MAX_TRACKED = 65_536  # documents whose heat is kept (the coolest are forgotten beyond it)


@dataclass(frozen=True)
class Copy:
    """Copy document ``key`` of ``namespace`` (its ``token_ids``) from ``source``'s memory to ``target``'s."""

    key: str
    namespace: str
    token_ids: tuple[int, ...]
    source: str
    target: str


@dataclass
class HotDocuments:
    """A document's heat is its uses, each halved every ``half_life`` requests; at ``min_heat`` or
    above it is hot. A hot document held in memory by one replica alone, whose queued prefill is at
    least ``imbalance_tokens`` above the least queued replica that does not hold it and whose pool is
    at most ``max_fill`` full, is copied there; at most ``per_round`` copies a call, and a document
    is not copied again within ``retry_s`` (its copy may not be announced yet)."""

    half_life: float = 64.0
    min_heat: float = 4.0
    imbalance_tokens: int = 4096
    max_fill: float = 0.9
    per_round: int = 4
    retry_s: float = 30.0
    requests: int = 0
    heat: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)  # -> (heat, at request number)
    hot: dict[tuple[str, str], tuple[int, ...]] = field(default_factory=dict)  # hot documents -> their token ids
    copied: dict[tuple[str, str], float] = field(default_factory=dict)  # -> when its copy was asked for

    def seen(self, request: RouteRequest, token_ids: list[tuple[int, ...]]) -> None:
        """A request named ``request.documents`` (``token_ids``: each one's ids, in order)."""
        self.requests += 1
        for (key, _), ids in zip(request.documents, token_ids):
            name = (request.namespace, key)
            heat = self.heat_of(name) + 1.0
            self.heat[name] = (heat, self.requests)
            if heat >= self.min_heat:
                self.hot[name] = ids
        if len(self.heat) > MAX_TRACKED:
            self._forget_coolest()

    def heat_of(self, name: tuple[str, str]) -> float:
        heat, at = self.heat.get(name, (0.0, self.requests))
        return heat * 0.5 ** ((self.requests - at) / self.half_life)

    def copies(self, loads: list[ReplicaLoad], index: DocumentIndex, now: float | None = None) -> list[Copy]:
        """The copies to make now (hot documents that cooled down are forgotten)."""
        now = time.monotonic() if now is None else now
        by_replica = {load.replica: load for load in loads}
        made: list[Copy] = []
        for name, ids in list(self.hot.items()):
            if self.heat_of(name) < self.min_heat:
                del self.hot[name]
            elif len(made) < self.per_round and now - self.copied.get(name, -self.retry_s) >= self.retry_s:
                copy = self._copy(name, ids, by_replica, index)
                if copy is not None:
                    self.copied[name] = now
                    made.append(copy)
        for name in [n for n, at in self.copied.items() if now - at >= self.retry_s]:
            del self.copied[name]
        return made

    def _copy(self, name: tuple[str, str], ids: tuple[int, ...], loads: dict[str, ReplicaLoad],
              index: DocumentIndex) -> Copy | None:
        holders = index.holders(*name)
        in_memory = [r for r, tier in holders.items() if tier == Tier.MEMORY and r in loads]
        if len(in_memory) != 1:
            return None  # nobody holds it to copy, or it has a second copy already
        source = loads[in_memory[0]]
        targets = [r for r, load in loads.items() if r not in holders and load.pool_fill <= self.max_fill]
        if not targets:
            return None
        target = least_queued(targets, {r: load.queued_prefill_tokens for r, load in loads.items()})
        if source.queued_prefill_tokens - loads[target].queued_prefill_tokens < self.imbalance_tokens:
            return None
        return Copy(name[1], name[0], ids, source.replica, target)

    def _forget_coolest(self) -> None:
        """Keep the warmer half of the documents tracked."""
        ranked = sorted(self.heat, key=self.heat_of)
        for name in ranked[: len(ranked) // 2]:
            del self.heat[name]
            self.hot.pop(name, None)
