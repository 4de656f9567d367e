"""The cluster router's routing decisions replayed against stand-in replicas, no engines and no clock:
what fraction of document segments a policy's choices find cached.

``hypic eval cluster``'s tenant workload is replayed the way one of its QPS levels runs (pools empty,
``warm`` requests of one slice of the stream one by one, then ``timed`` of another), each request routed by the
real policy over the real ``DocumentIndex``. Each stand-in replica holds whole documents in a
least-recently-used pool of ``pool_tokens`` document tokens (an entry's bytes taken as its tokens)
and announces what it stores and evicts at once. With ``fetch``, a document the chosen replica lacks
and another holds is fetched from that one (its use there counts as a use) instead of built, and
kept as a copy only with ``keep_fetched``; a document no replica holds is built ("cold"). Load is modelled as tokens: a request adds what its
replica prefills for it to that replica's queue, and every queue drains ``drain_tokens`` per request
(the offered load: less drain is a busier cluster). Segment hit rates are counted over the timed
requests, as the study counts them.
"""
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hypic.cluster.index import Announcement, DocumentIndex, HoldingEvent, Tier
from hypic.cluster.routing import ReplicaLoad, RouteRequest, RoutingPolicy

from .tenants import TenantConfig, TenantRequest, TenantWorkload

QUESTION_TOKENS = 30  # a request's system line and question, prefilled wherever it goes


@dataclass
class StandInReplica:
    """A least-recently-used pool of whole documents and the holding events it has not announced."""

    name: str
    pool_tokens: int
    held: OrderedDict[str, int] = field(default_factory=OrderedDict)
    peers: list["StandInReplica"] = field(default_factory=list, repr=False)  # every replica, itself included
    seq: int = 0
    queued: float = 0.0

    def fill(self) -> float:
        return min(1.0, sum(self.held.values()) / self.pool_tokens)

    def serve(self, documents: tuple[tuple[str, int], ...], namespace: str = "",
              others: list["StandInReplica"] | None = None, keep_fetched: bool = True) -> tuple[Counter, int, list[HoldingEvent]]:
        """Look up and store ``documents`` (of ``namespace``); with ``others``, fetch from them what they
        hold. Counts (hit, fetched, rebuilt: built though another held it, cold: no replica held it),
        the tokens that needed no prefill, and what changed here."""
        counts: Counter = Counter()
        cached, events = 0, []
        for key, tokens in documents:
            holder = next((r for r in others or () if key in r.held), None)
            if key in self.held:
                counts["hit"], cached = counts["hit"] + 1, cached + tokens
            elif holder is not None:
                holder.held.move_to_end(key)  # it served the document
                counts["fetched"], cached = counts["fetched"] + 1, cached + tokens
                if not keep_fetched:
                    continue
            else:
                counts["cold" if others is not None or not self._held_elsewhere(key) else "rebuilt"] += 1
            if key not in self.held:
                events.append(HoldingEvent("stored", key, namespace, Tier.MEMORY, tokens))
            self.held[key] = tokens
            self.held.move_to_end(key)
        return counts, cached, events + self._evict()

    def _held_elsewhere(self, key: str) -> bool:
        return any(key in r.held for r in self.peers if r is not self)

    def _evict(self) -> list[HoldingEvent]:
        events = []
        while sum(self.held.values()) > self.pool_tokens and len(self.held) > 1:
            key, _ = self.held.popitem(last=False)
            events.append(HoldingEvent("evicted", key, "", Tier.MEMORY))
        return events

    def announcement(self, events: list[HoldingEvent]) -> Announcement:
        self.seq += len(events)
        return Announcement(self.name, "stand-in", self.seq, tuple(events))


@dataclass(frozen=True)
class ReplayShape:
    """The stand-in cluster: replicas, each pool's document tokens, a document's tokens, the drain."""

    replicas: int = 2
    pool_tokens: int = 25 * 285
    doc_tokens: int = 285
    drain_tokens: float = 300.0
    warm: int = 16
    timed: int = 96
    fetch: bool = False  # a document another replica holds is fetched from it, not built
    keep_fetched: bool = True  # a fetched document is kept where it was fetched to


def route_request(request: TenantRequest, doc_tokens: int) -> RouteRequest:
    """What the router sees of ``request``: its documents' keys and tokens, in its salt's namespace."""
    parts = tuple((f"tenant-{request.tenant}/document-{d}", doc_tokens) for d in request.documents)
    return RouteRequest(request.salt or "", parts, doc_tokens * len(parts) + QUESTION_TOKENS)


def replay_level(policy: RoutingPolicy, workload: TenantWorkload, shape: ReplayShape) -> dict[str, float]:
    """One level from empty pools, over the timed requests' document uses: the share found where the
    request went (``segment_hit_rate``), that share with the documents fetched from another replica
    (``hit_rate_with_fetch``), the shares fetched, rebuilt though another replica held them, and built
    because none did (``cold``); and how many tenants' documents are held on more than one replica at
    its end (``split_tenants``)."""
    replicas = [StandInReplica(f"replica-{r}", shape.pool_tokens) for r in range(shape.replicas)]
    for replica in replicas:
        replica.peers = replicas
    index = DocumentIndex()
    for replica in replicas:
        index.apply(Announcement(replica.name, "stand-in", 0, (), full=True))
    stream = workload.requests(shape.warm, 0) + workload.requests(shape.timed, 1)
    counts: Counter = Counter()
    for number, request in enumerate(stream):
        drain = shape.drain_tokens if number >= shape.warm else math.inf  # the warm-up goes one by one
        found = _route_one(policy, route_request(request, shape.doc_tokens), replicas, index, drain, shape)
        if number >= shape.warm:
            counts += found
    uses = counts["hit"] + counts["fetched"] + counts["rebuilt"] + counts["cold"]
    return {"segment_hit_rate": counts["hit"] / uses, "hit_rate_with_fetch": (counts["hit"] + counts["fetched"]) / uses,
            "fetched": counts["fetched"] / uses, "rebuilt": counts["rebuilt"] / uses, "cold": counts["cold"] / uses,
            "split_tenants": split_tenants(replicas)}


def split_tenants(replicas: list[StandInReplica]) -> int:
    """Tenants whose documents more than one replica holds (a document key is ``tenant-T/document-D``)."""
    homes: dict[str, set[str]] = {}
    for replica in replicas:
        for key in replica.held:
            homes.setdefault(key.split("/")[0], set()).add(replica.name)
    return sum(len(held_by) > 1 for held_by in homes.values())


def _route_one(policy: RoutingPolicy, request: RouteRequest, replicas: list[StandInReplica],
               index: DocumentIndex, drain: float, shape: ReplayShape) -> Counter:
    loads = [ReplicaLoad(r.name, queued_prefill_tokens=int(r.queued), pool_fill=r.fill()) for r in replicas]
    name = policy.choose(request, loads, index).replica
    chosen = next(r for r in replicas if r.name == name)
    others = [r for r in replicas if r is not chosen] if shape.fetch else None
    counts, cached, events = chosen.serve(request.documents, request.namespace, others, shape.keep_fetched)
    chosen.queued += request.prompt_tokens - cached
    for replica in replicas:
        replica.queued = max(0.0, replica.queued - drain)
    if events:
        index.apply(chosen.announcement(events))
    return counts


def mean_hit_rate(make_policy: Callable[[], RoutingPolicy], config: TenantConfig, shape: ReplayShape,
                  seeds: range) -> float:
    """The timed segment hit rate averaged over one level per workload seed (a fresh policy each)."""
    rates = [replay_level(make_policy(), TenantWorkload(replace(config, seed=seed)), shape)["segment_hit_rate"]
             for seed in seeds]
    return sum(rates) / len(rates)

