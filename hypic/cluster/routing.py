"""Which replica serves a request: routing policies over the replicas' loads and what the
``DocumentIndex`` believes they hold, and the spread of warm-up documents.

Policies are pure: they read the request, the loads the ingress keeps and the index, and name a
replica; the ingress applies the choice and updates its own bookkeeping.

- ``cache_aware`` (default): the replica with the least work for this request, counting what it
  would prefill given what it holds, the prefill queued on it and its decode load; a replica far
  above the others' mean queue is skipped.
- ``ttft``: the replica predicted to give the first token soonest, in seconds at the rates each
  replica measures (its prefill tokens/s, its decode step, how fast entries reach it from another
  replica), plus the same placement terms in seconds; cache_aware's choice until a rate is measured.
- ``prefix``: the longest leading-prefix match (what single-server routers do), then load.
- ``power_of_two``: the less busy of two random replicas. ``round_robin``: each in turn.
"""
import math
import random
from dataclasses import dataclass, field
from typing import Protocol

from hypic.router.lpt import least_queued, lpt_assign, spread_builds

from .index import DocumentIndex, Tier


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs of a request, computed once at the ingress: ``documents``: (entry key,
    tokens) of each PIC document in prompt order; ``prompt_tokens``: the whole prompt's length;
    ``token_ids``: the prompt's ids, for prefix matching (may be empty)."""

    namespace: str
    documents: tuple[tuple[str, int], ...]
    prompt_tokens: int
    token_ids: tuple[int, ...] = ()

    def document_tokens(self) -> int:
        return sum(tokens for _, tokens in self.documents)


@dataclass(frozen=True)
class ReplicaRates:
    """How fast a replica works, as it measured: prompt tokens its prefill passes compute a second,
    the seconds of one decode step at its batch, document tokens a second that reach it from another
    replica's pool, and the most prompt tokens one of its prefill steps takes (between two decode steps)."""

    prefill_tokens_per_s: float
    decode_step_s: float | None = None
    fetch_tokens_per_s: float | None = None
    chunk_tokens: int | None = None


@dataclass
class ReplicaLoad:
    """What the ingress has sent a replica and it has not finished: prefill tokens not yet prefilled,
    requests, and tokens left to decode (the requests' max_new_tokens budgets); and its measured
    ``rates`` (None: not measured yet)."""

    replica: str
    queued_prefill_tokens: int = 0
    running: int = 0
    decode_tokens: int = 0
    pool_fill: float = 0.0  # its public pool's bytes over its budget (0: empty or unbounded, 1: full)
    rates: ReplicaRates | None = None


@dataclass(frozen=True)
class TierCosts:
    """The cost of loading one token's entry from a tier, in prefill-token units (1 = as dear as
    prefilling it; memory is free)."""

    memory: float = 0.0
    host: float = 0.05
    disk: float = 0.2
    shared: float = 0.3  # a shared store (Mooncake), over the network

    @classmethod
    def from_rates(cls, prefill_tokens_per_s: float, host_tokens_per_s: float,
                   disk_tokens_per_s: float) -> "TierCosts":
        """From measured rates: a tier's credit is the time to load a token from it over the time to
        prefill one (capped at 1: a load slower than prefill is never better than a miss)."""
        if min(prefill_tokens_per_s, host_tokens_per_s, disk_tokens_per_s) <= 0:
            raise ValueError("rates must be > 0 tokens/s")
        return cls(0.0, min(1.0, prefill_tokens_per_s / host_tokens_per_s),
                   min(1.0, prefill_tokens_per_s / disk_tokens_per_s))

    def of(self, tier: Tier) -> float:
        return (self.memory, self.host, self.disk, self.shared)[tier]


@dataclass(frozen=True)
class Decision:
    """The chosen replica; ``reason``: "cache" (chosen for what it holds: documents, a prefix, most of
    the request's namespace), "load" (nothing held decided it, or the imbalance guard overrode the
    cheapest), "round_robin" or "random";
    ``costs``: replica -> the cost the policy scored (for logs and tests)."""

    replica: str
    reason: str
    costs: dict[str, float]


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, loads: list[ReplicaLoad], index: DocumentIndex) -> Decision: ...


def _check_loads(loads: list[ReplicaLoad]) -> None:
    if not loads:
        raise ValueError("no replicas to route to")


def _by_load(load: ReplicaLoad) -> tuple[int, int, str]:
    """Least queued prefill first, then fewer requests, then the lowest id."""
    return load.queued_prefill_tokens, load.running, load.replica


DECODE_WEIGHT = 0.1  # prefill tokens' worth of a replica's time one token it still has to decode takes
# A new document's tokens stored in a full pool push out as many of documents still in use, each missed
# later and pushing out more when stored again: 2 had the best worst case of the weights tried in replays
# of the cluster study's tenant workload against stand-in pools (eval/sim_cluster_pools.py).
EVICTION_WEIGHT = 2.0
# A named namespace (a cache salt) is one tenant's documents, asked for together: a document new to the
# cluster stored away from the rest of its namespace splits the tenant, whose later requests then miss
# on whichever replica they land.
NAMESPACE_WEIGHT = 0.5  # the best worst case of 0 to 4 in replays with a namespace per tenant
IMBALANCE_FACTOR = 2.0  # a replica queued above this times the others' mean queue is skipped...
IMBALANCE_FLOOR = 8192  # ...if its queue is also above this many tokens


@dataclass
class CacheAware:
    """cost(replica) = the tokens it would prefill for this request given what it holds (a document held
    in memory: 0; in host or disk: its tokens x that tier's credit; not held: its tokens; the rest of
    the prompt: its tokens; or, if less, the prompt past the prefix it is believed to hold) + its queued
    prefill tokens + ``decode_weight`` x its tokens left to decode + ``eviction_weight`` x how full its
    pool is x the documents' tokens it would newly store, those another replica holds already counted
    twice (storing into a full pool evicts as much, and a second copy takes room from the documents
    the replicas hold between them: new documents go where there is room, and the working set spreads
    over the replicas instead of being copied) + ``namespace_weight`` x the share of the request's
    named namespace held in memory elsewhere x the tokens of its documents no replica holds (a tenant's new
    documents join the rest of the tenant). Cheapest wins (ties: fewer running, then the lowest
    id), except that a replica queued above ``imbalance_factor`` x the others' mean queue and
    above ``imbalance_floor`` tokens is skipped unless every replica is."""

    tier_costs: TierCosts = field(default_factory=TierCosts)
    decode_weight: float = DECODE_WEIGHT
    eviction_weight: float = EVICTION_WEIGHT
    namespace_weight: float = NAMESPACE_WEIGHT
    imbalance_factor: float = IMBALANCE_FACTOR
    imbalance_floor: int = IMBALANCE_FLOOR
    fetch_credit: float | None = None  # a document or prompt head held in memory elsewhere, fetched (None: rebuilt)
    name: str = "cache_aware"

    def choose(self, request: RouteRequest, loads: list[ReplicaLoad], index: DocumentIndex) -> Decision:
        _check_loads(loads)
        replicas = [load.replica for load in loads]
        held_by = holders_of(request, index)
        prefill = self._prefill(request, replicas, held_by, index)
        scattered = scattered_tokens(request, replicas, held_by, index)
        stored = stored_tokens(request, replicas, held_by)
        evicting, splitting = self.eviction_weight, self.namespace_weight
        costs = {load.replica: prefill[load.replica] + load.queued_prefill_tokens + self.decode_weight * load.decode_tokens
                 + evicting * load.pool_fill * stored[load.replica] + splitting * scattered[load.replica] for load in loads}
        return self.cheapest(request, loads, costs, prefill, scattered)

    def cheapest(self, request: RouteRequest, loads: list[ReplicaLoad], costs: dict[str, float],
                 prefill: dict[str, float], scattered: dict[str, float]) -> Decision:
        """The cheapest replica by ``costs`` (ties: fewer running, then the lowest id), unless the
        imbalance guard skips it; "cache" when what it holds decided it."""
        def rank(load: ReplicaLoad) -> tuple[float, int, str]:
            return costs[load.replica], load.running, load.replica

        lowest = min(costs.values())
        cheapest = min((load for load in loads if costs[load.replica] == lowest), key=rank)
        total, others = sum(load.queued_prefill_tokens for load in loads), max(1, len(loads) - 1)
        if self._swamped(cheapest, total, others):
            allowed = [load for load in loads if not self._swamped(load, total, others)]
            if allowed:
                return Decision(min(allowed, key=rank).replica, "load", costs)
        chosen = cheapest.replica
        held = prefill[chosen] < request.prompt_tokens or scattered[chosen] < max(scattered.values())
        return Decision(chosen, "cache" if held else "load", costs)

    def placement_tokens(self, loads: list[ReplicaLoad], stored: dict[str, int],
                         scattered: dict[str, float]) -> dict[str, float]:
        """Replica -> what placing the request there costs later, in prefill tokens: the documents it
        would store anew (``stored_tokens``) x ``eviction_weight`` x how full its pool is, and its
        namespace's split (``scattered_tokens``) x ``namespace_weight``."""
        return {load.replica: self.eviction_weight * load.pool_fill * stored[load.replica]
                + self.namespace_weight * scattered[load.replica] for load in loads}

    def prefill_tokens(self, request: RouteRequest, replicas: list[str], index: DocumentIndex) -> dict[str, float]:
        """Replica -> the tokens it would prefill for ``request``, given what the index says it holds."""
        return self._prefill(request, replicas, holders_of(request, index), index)

    def _prefill(self, request: RouteRequest, replicas: list[str], held_by: list[dict[str, Tier]],
                 index: DocumentIndex, fetch_credits: dict[str, float] | None = None) -> dict[str, float]:
        """Replica -> the tokens it would prefill; ``fetch_credits``: each replica's price of a token
        fetched from another's memory, in prefill tokens (None: ``fetch_credit`` for every one). What
        a replica saves on the documents it does not hold (from the shared store, or fetched) is
        priced by totals; only a document's holders are visited, so a decision's work grows with the
        replicas plus the holdings, not their product."""
        credits = fetch_credits if fetch_credits is not None else (
            None if self.fetch_credit is None else dict.fromkeys(replicas, self.fetch_credit))
        documents = [(tokens, index.shared(request.namespace, key), credits is not None and Tier.MEMORY in holders.values())
                     for (key, tokens), holders in zip(request.documents, held_by)]  # (tokens, shared, fetchable)
        totals = [sum(t for t, shared, fetchable in documents if (shared, fetchable) == kind)
                  for kind in ((True, True), (False, True), (True, False))]
        one_price = credits is None or len(set(credits.values())) <= 1  # cache_aware's; ttft's differ by replica
        price = (next(iter(credits.values())) if credits else 1.0) if one_price else 0.0
        members, own = set(replicas), {}  # replica -> what its own copies save beyond what every replica may use
        for (tokens, shared, fetchable), holders in zip(documents, held_by):
            for replica, tier in holders.items():
                if replica in members:
                    anyway = self._unheld_saving(*_one(tokens, shared, fetchable), price if one_price else credits[replica])
                    own[replica] = own.get(replica, 0.0) + max(0.0, tokens * (1.0 - self.tier_costs.of(tier)) - anyway)
        document_tokens = request.document_tokens()
        rest = max(0, request.prompt_tokens - document_tokens)
        matched = index.prefix_matched(request.token_ids, request.namespace) if request.token_ids else {}
        longest = max(matched.values()) if credits is not None and matched else 0  # any replica may fetch it

        def tokens_at(replica: str | None, credit: float) -> float:
            saved = self._unheld_saving(*totals, credit) + own.get(replica, 0.0)  # type: ignore[arg-type]
            head = max(matched.get(replica, 0), longest * (1.0 - credit))  # type: ignore[arg-type]
            return min(document_tokens - saved + rest, max(0, request.prompt_tokens - head))

        if not one_price:
            return {replica: tokens_at(replica, credits[replica]) for replica in replicas}  # type: ignore[index]
        prefill = dict.fromkeys(replicas, tokens_at(None, price))  # a replica that holds nothing of it
        for replica in members.intersection({*own, *matched}):
            prefill[replica] = tokens_at(replica, price)
        return prefill

    def _unheld_saving(self, both: float, fetched: float, shared: float, credit: float) -> float:
        """What a replica saves on documents it does not hold itself, of ``both`` tokens in the shared
        store and fetchable, ``fetched`` only fetchable, ``shared`` only in the store: each at the
        cheaper of the store's load cost and ``credit``."""
        store = self.tier_costs.shared
        return both * (1.0 - min(store, credit)) + fetched * (1.0 - credit) + shared * (1.0 - store)

    def _swamped(self, load: ReplicaLoad, total: int, others: int) -> bool:
        """Whether ``load``'s replica is queued above ``imbalance_factor`` x the mean queue of the
        others (``total``: every replica's queue; ``others``: their count) and above the floor."""
        queued = load.queued_prefill_tokens
        return queued > max(self.imbalance_factor * (total - queued) / others, self.imbalance_floor)


@dataclass
class PredictedTtft(CacheAware):
    """cost(replica) = the seconds until the request's first token there (``ttft_seconds``: the prefill
    queued on it and what it would prefill of this request, a document or prompt head held in another
    replica's memory priced at the rate entries reach it, and the decode steps its loop runs between
    prefill chunks meanwhile), at the rates the replica measured, + cache_aware's placement terms in
    seconds of its prefill. The imbalance guard and ties as cache_aware's; until some replica has
    measured its rates, cache_aware's choice in tokens."""

    name: str = "ttft"

    def choose(self, request: RouteRequest, loads: list[ReplicaLoad], index: DocumentIndex) -> Decision:
        _check_loads(loads)
        if any(load.rates is None for load in loads):
            return super().choose(request, loads, index)
        replicas = [load.replica for load in loads]
        held_by = holders_of(request, index)
        prefill = self._prefill(request, replicas, held_by, index, self._fetch_credits(loads))
        scattered = scattered_tokens(request, replicas, held_by, index)
        placement = self.placement_tokens(loads, stored_tokens(request, replicas, held_by), scattered)
        costs = {load.replica: ttft_seconds(load, prefill[load.replica])
                 + placement[load.replica] / _measured(load).prefill_tokens_per_s for load in loads}
        return self.cheapest(request, loads, costs, prefill, scattered)

    def predicted_ttft(self, request: RouteRequest, loads: list[ReplicaLoad], index: DocumentIndex) -> dict[str, float]:
        """Replica -> the seconds until ``request``'s first token there (``ttft_seconds``), for those
        with measured rates."""
        timed = [load for load in loads if load.rates is not None]
        replicas = [load.replica for load in timed]
        prefill = self._prefill(request, replicas, holders_of(request, index), index, self._fetch_credits(timed))
        return {load.replica: ttft_seconds(load, prefill[load.replica]) for load in timed}

    def _fetch_credits(self, loads: list[ReplicaLoad]) -> dict[str, float] | None:
        """Each replica's price of a fetched token in its prefill tokens: its prefill rate over the
        rate entries reached it (at most 1: a fetch slower than a build is not taken as cheaper);
        ``fetch_credit`` until it has measured one. None: documents are not fetched."""
        if self.fetch_credit is None:
            return None
        return {load.replica: fetch_credit_of(_measured(load), self.fetch_credit) for load in loads}


def _measured(load: ReplicaLoad) -> ReplicaRates:
    assert load.rates is not None
    return load.rates


def fetch_credit_of(rates: ReplicaRates, unmeasured: float) -> float:
    """A fetched token's price in prefill tokens: prefill rate over fetch rate (``unmeasured`` where
    no fetch was timed), at most 1."""
    if not rates.fetch_tokens_per_s:
        return unmeasured
    return min(1.0, rates.prefill_tokens_per_s / rates.fetch_tokens_per_s)


def ttft_seconds(load: ReplicaLoad, tokens: float) -> float:
    """The seconds until the first token of a request that prefills ``tokens`` (prefill-token
    equivalents) on ``load``'s replica, at its measured rates: the prefill queued there and its own
    at its prefill rate; while it decodes, its loop also runs a decode step after each prefill
    chunk (``chunk_tokens``): half of the one under way, then one a chunk before the request's last."""
    rates = _measured(load)
    work = load.queued_prefill_tokens + tokens
    seconds = work / rates.prefill_tokens_per_s
    if load.decode_tokens > 0 and rates.decode_step_s is not None:
        chunks = math.ceil(work / rates.chunk_tokens) if rates.chunk_tokens else 1
        seconds += (max(1, chunks) - 0.5) * rates.decode_step_s
    return seconds


def tbt_seconds(load: ReplicaLoad) -> float | None:
    """The seconds between two tokens of a request decoding on ``load``'s replica: its decode step
    (as measured at its batch) and the prefill chunk its loop runs between two steps while prefill is
    queued there; None: no decode step measured."""
    rates = load.rates
    if rates is None or rates.decode_step_s is None:
        return None
    chunk = min(load.queued_prefill_tokens, rates.chunk_tokens or load.queued_prefill_tokens)
    return rates.decode_step_s + chunk / rates.prefill_tokens_per_s


def _one(tokens: int, shared: bool, fetchable: bool) -> tuple[int, int, int]:
    """One document's tokens as ``_unheld_saving``'s (both, fetched, shared) totals."""
    return (tokens if shared and fetchable else 0, tokens if fetchable and not shared else 0,
            tokens if shared and not fetchable else 0)


def holders_of(request: RouteRequest, index: DocumentIndex) -> list[dict[str, Tier]]:
    """Each of ``request``'s documents' holders (replica -> its cheapest tier), looked up once."""
    return [index.holders(request.namespace, key) for key, _ in request.documents]


def stored_tokens(request: RouteRequest, replicas: list[str], held_by: list[dict[str, Tier]]) -> dict[str, int]:
    """Replica -> the tokens of ``request``'s documents it would store anew (it holds them in no tier),
    those another replica holds counted twice."""
    charges = [tokens * (2 if holders else 1) for (_, tokens), holders in zip(request.documents, held_by)]
    stored = dict.fromkeys(replicas, sum(charges))
    for charge, holders in zip(charges, held_by):
        for replica in holders:
            if replica in stored:
                stored[replica] -= charge
    return stored


def scattered_tokens(request: RouteRequest, replicas: list[str], held_by: list[dict[str, Tier]],
                     index: DocumentIndex) -> dict[str, float]:
    """Replica -> the tokens of ``request``'s documents no replica holds x the share of its namespace's
    entries in memory that other replicas hold (0 everywhere in the shared namespace, or before any is
    held)."""
    held = index.namespace_holders(request.namespace) if request.namespace else {}
    total = sum(held.values())
    if not total:
        return dict.fromkeys(replicas, 0.0)
    new = sum(tokens for (_, tokens), holders in zip(request.documents, held_by) if not holders)
    scattered = dict.fromkeys(replicas, float(new))
    for replica, count in held.items():
        if replica in scattered:
            scattered[replica] = new * (1 - count / total)
    return scattered


@dataclass
class PrefixMatch:
    """The replica believed to hold the longest leading prefix of the prompt (documents count only as
    far as they are in it); ties and no match: the least loaded."""

    name: str = "prefix"

    def choose(self, request: RouteRequest, loads: list[ReplicaLoad], index: DocumentIndex) -> Decision:
        _check_loads(loads)
        matched = index.prefix_matched(request.token_ids, request.namespace) if request.token_ids else {}
        costs = {load.replica: float(max(0, request.prompt_tokens - matched.get(load.replica, 0))) for load in loads}
        chosen = min(loads, key=lambda load: (costs[load.replica], *_by_load(load)))
        return Decision(chosen.replica, "cache" if matched.get(chosen.replica) else "load", costs)


@dataclass
class RoundRobin:
    """Each replica in turn, in id order."""

    name: str = "round_robin"
    turn: int = 0

    def choose(self, request: RouteRequest, loads: list[ReplicaLoad], index: DocumentIndex) -> Decision:
        _check_loads(loads)
        replicas = sorted(load.replica for load in loads)
        chosen = replicas[self.turn % len(replicas)]
        self.turn += 1
        return Decision(chosen, "round_robin", {})


@dataclass
class PowerOfTwo:
    """Two replicas drawn at random (``rng``), the one with fewer requests (then less queued prefill,
    then the first drawn: with two replicas both are always drawn, and the lower id must not always win)."""

    rng: random.Random = field(default_factory=random.Random)
    name: str = "power_of_two"

    def choose(self, request: RouteRequest, loads: list[ReplicaLoad], index: DocumentIndex) -> Decision:
        _check_loads(loads)
        drawn = self.rng.sample(loads, min(2, len(loads)))
        costs = {load.replica: float(load.running) for load in drawn}
        chosen = min(drawn, key=lambda load: (load.running, load.queued_prefill_tokens))
        return Decision(chosen.replica, "random", costs)


_POLICIES = {"cache_aware": CacheAware, "ttft": PredictedTtft, "round_robin": RoundRobin, "power_of_two": PowerOfTwo, "prefix": PrefixMatch}
POLICIES: tuple[str, ...] = tuple(_POLICIES)


def policy_named(name: str = "cache_aware", **options) -> RoutingPolicy:
    """The routing policy called ``name``, built with ``options`` (its fields)."""
    if name not in _POLICIES:
        raise ValueError(f"unknown routing policy {name}: expected one of {', '.join(POLICIES)}")
    try:
        return _POLICIES[name](**options)
    except TypeError as error:
        raise ValueError(f"bad options for routing policy {name}: {error}") from None


def spread_documents(tokens: list[int], loads: list[ReplicaLoad]) -> list[str]:
    """Warm-up: the replica of each document, longest first to the least queued so far (LPT over the
    replicas' queued prefill tokens)."""
    _check_loads(loads)
    assignment = lpt_assign(tokens, [load.queued_prefill_tokens for load in loads])
    return [loads[slot].replica for slot in assignment]


MIN_SPREAD_TOKENS = 128  # a shorter document is built where it is needed: shipping it costs about what building it saves
# what moving a document's entry from the replica that holds it costs, in prefill tokens of it: a 285-token
# document's entry (1.7 MB on the shipped model) crosses Ray's object store and is checked in a few ms, where
# prefilling it takes some 100 ms on a CPU core
FETCH_CREDIT = 0.05


def fetch_sources(request: RouteRequest, combine: str, loads: list[ReplicaLoad], index: DocumentIndex,
                  min_tokens: int = 0) -> dict[str, list[int]]:
    """Which of ``request``'s documents ``combine`` (the replica that serves it) holds in no tier while
    another replica holds them in memory: fetched from that one (the least queued of their holders)
    instead of built. Replica -> the indices (into ``request.documents``) it sends; documents shorter
    than ``min_tokens`` are built where they are needed (none by default: one call per holder brings
    all it sends, and a short document fetched is still a hit)."""
    queued = {load.replica: load.queued_prefill_tokens for load in loads}
    sources: dict[str, list[int]] = {}
    for number, (key, tokens) in enumerate(request.documents):
        holders = index.holders(request.namespace, key)
        held = [r for r, tier in holders.items() if tier == Tier.MEMORY and r in queued and r != combine]
        if tokens >= min_tokens and combine not in holders and held:
            sources.setdefault(least_queued(held, queued), []).append(number)
    return sources


# a head shorter than one block of the prefix index is not worth a call to another replica
MIN_PREFIX_FETCH_TOKENS = 64


def prefix_source(request: RouteRequest, combine: str, loads: list[ReplicaLoad], index: DocumentIndex,
                  min_tokens: int = MIN_PREFIX_FETCH_TOKENS) -> str | None:
    """The replica that sends ``combine`` (the replica that serves ``request``) the head of its prompt
    from its private pool: the one believed to hold the longest head, if at least ``min_tokens``
    longer than ``combine``'s (ties: the least queued, then the lowest id); None: ``combine``
    computes what it lacks."""
    if not request.token_ids:
        return None
    matched = index.prefix_matched(request.token_ids, request.namespace)
    queued = {load.replica: load.queued_prefill_tokens for load in loads}
    own = matched.get(combine, 0)
    holders = [r for r, tokens in matched.items() if r in queued and r != combine and tokens >= own + min_tokens]
    return min(holders, key=lambda r: (-matched[r], queued[r], r)) if holders else None


def spread_cold_documents(request: RouteRequest, combine: str, loads: list[ReplicaLoad], index: DocumentIndex,
                          min_tokens: int = MIN_SPREAD_TOKENS, fetched: frozenset[int] = frozenset()) -> dict[str, list[int]]:
    """Which of ``request``'s documents other replicas build for it, in parallel with ``combine``
    (the replica that serves it): replica -> the indices (into ``request.documents``) it builds.
    The documents ``combine`` does not hold (of at least ``min_tokens``) are placed longest first,
    each on the replica least loaded so far (LPT), ``combine``'s load counting the rest of the
    prompt it computes anyway; those it keeps, and any other replica's empty share, are left out, as
    are the documents in ``fetched`` (indices: ``fetch_sources``)."""
    _check_loads(loads)
    held = {i for i, (key, _) in enumerate(request.documents) if combine in index.holders(request.namespace, key)}
    held |= fetched
    cold = [i for i, (_, tokens) in enumerate(request.documents) if i not in held and tokens >= min_tokens]
    rest = request.prompt_tokens - sum(request.documents[i][1] for i in cold)
    queued = {load.replica: load.queued_prefill_tokens for load in loads}
    shares = spread_builds([request.documents[i][1] for i in cold], queued, combine, rest)
    return {replica: [cold[i] for i in indices] for replica, indices in shares.items() if replica != combine}
