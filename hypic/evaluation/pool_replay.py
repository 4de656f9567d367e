"""The cluster router's routing decisions replayed against stand-in replicas, no engines and no clock:
what fraction of document segments a policy's choices find cached.

``hypic eval cluster``'s tenant workload is replayed the way one of its QPS levels runs (pools empty,
``warm`` requests of one slice of the stream one by one, then ``timed`` of another), each request routed by the
real policy over the real ``DocumentIndex``. Each stand-in replica holds whole documents in a
least-recently-used pool of ``pool_tokens`` document tokens (an entry's bytes taken as its tokens)
and announces what it stores and evicts at once. Load is modelled as tokens: a request adds what its
replica prefills for it to that replica's queue, and every queue drains ``drain_tokens`` per request
(the offered load: less drain is a busier cluster). Segment hit rates are counted over the timed
requests, as the study counts them.
"""
import math
from collections import OrderedDict
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
    seq: int = 0
    queued: float = 0.0

    def fill(self) -> float:
        return min(1.0, sum(self.held.values()) / self.pool_tokens)

    def serve(self, documents: tuple[tuple[str, int], ...], namespace: str = "") -> tuple[int, int, list[HoldingEvent]]:
        """Look up and store ``documents`` (of ``namespace``): how many were held, their tokens, and what
        changed."""
        hits = cached = 0
        events = []
        for key, tokens in documents:
            if key in self.held:
                hits, cached = hits + 1, cached + tokens
            else:
                events.append(HoldingEvent("stored", key, namespace, Tier.MEMORY, tokens))
            self.held[key] = tokens
            self.held.move_to_end(key)
        return hits, cached, events + self._evict()

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


def route_request(request: TenantRequest, doc_tokens: int) -> RouteRequest:
    """What the router sees of ``request``: its documents' keys and tokens, in its salt's namespace."""
    parts = tuple((f"tenant-{request.tenant}/document-{d}", doc_tokens) for d in request.documents)
    return RouteRequest(request.salt or "", parts, doc_tokens * len(parts) + QUESTION_TOKENS)


def replay_level(policy: RoutingPolicy, workload: TenantWorkload, shape: ReplayShape) -> dict[str, float]:
    """One level from empty pools: the timed requests' segment hit rate, and how many tenants' documents
    are held on more than one replica at its end (``split_tenants``)."""
    replicas = [StandInReplica(f"replica-{r}", shape.pool_tokens) for r in range(shape.replicas)]
    index = DocumentIndex()
    for replica in replicas:
        index.apply(Announcement(replica.name, "stand-in", 0, (), full=True))
    stream = workload.requests(shape.warm, 0) + workload.requests(shape.timed, 1)
    hits = routed = 0
    for number, request in enumerate(stream):
        drain = shape.drain_tokens if number >= shape.warm else math.inf  # the warm-up goes one by one
        found = _route_one(policy, route_request(request, shape.doc_tokens), replicas, index, drain)
        if number >= shape.warm:
            hits, routed = hits + found, routed + len(request.documents)
    return {"segment_hit_rate": hits / routed, "split_tenants": split_tenants(replicas)}


def split_tenants(replicas: list[StandInReplica]) -> int:
    """Tenants whose documents more than one replica holds (a document key is ``tenant-T/document-D``)."""
    homes: dict[str, set[str]] = {}
    for replica in replicas:
        for key in replica.held:
            homes.setdefault(key.split("/")[0], set()).add(replica.name)
    return sum(len(held_by) > 1 for held_by in homes.values())


def _route_one(policy: RoutingPolicy, request: RouteRequest, replicas: list[StandInReplica],
               index: DocumentIndex, drain: float) -> int:
    loads = [ReplicaLoad(r.name, queued_prefill_tokens=int(r.queued), pool_fill=r.fill()) for r in replicas]
    name = policy.choose(request, loads, index).replica
    chosen = next(r for r in replicas if r.name == name)
    hits, cached, events = chosen.serve(request.documents, request.namespace)
    chosen.queued += request.prompt_tokens - cached
    for replica in replicas:
        replica.queued = max(0.0, replica.queued - drain)
    if events:
        index.apply(chosen.announcement(events))
    return hits


def mean_hit_rate(make_policy: Callable[[], RoutingPolicy], config: TenantConfig, shape: ReplayShape,
                  seeds: range) -> float:
    """The timed segment hit rate averaged over one level per workload seed (a fresh policy each)."""
    rates = [replay_level(make_policy(), TenantWorkload(replace(config, seed=seed)), shape)["segment_hit_rate"]
             for seed in seeds]
    return sum(rates) / len(rates)

