"""What the ingress knows of its replicas: which documents each holds (the index, kept by their
holdings streams), how much work each has been given, and the policy that picks one per request.
The request router and the ingress run in one process and share it by name."""
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from .index import Announcement, DocumentIndex
from .routing import Decision, ReplicaLoad, ReplicaRates, RouteRequest, RoutingPolicy, tbt_seconds, ttft_seconds

log = logging.getLogger("hypic.cluster")
GONE_KEPT = 1024  # replicas gone that are remembered (Ray Serve never reuses a replica's id)


@dataclass(frozen=True)
class RouteTo:
    """The first argument of every call to a replica: what its router decides by. ``key``: the
    ingress's own name for the call, unique among its calls (a client may send one ``rid`` twice);
    ``replica``: a call for that replica alone (its share of a warm-up, a flush, a dump, a request
    the ingress placed itself for ``reason``); else ``request`` is routed by the policy."""

    key: str
    request: RouteRequest | None = None
    replica: str | None = None
    decode_tokens: int = 0  # the tokens it may decode (max_new_tokens times its samples)
    avoid: frozenset[str] = frozenset()  # replicas that already failed or refused it: others first
    reason: str = "load"  # why the ingress placed it on ``replica`` (counted as ``routed_by_<reason>``)
    fetched: frozenset[str] = frozenset()  # its documents another replica sends it from its pool: no prefill


@dataclass
class InFlight:
    replica: str
    prefill_tokens: int
    decode_tokens: int
    namespace: str = ""
    new_documents: tuple[str, ...] = ()  # documents its replica did not hold when it was routed: pending there


class ClusterState:
    """The index, the replicas' loads and the routing counters, safe from the router's and the
    ingress's threads."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy, self.index = policy, DocumentIndex()
        self.replicas: list[str] = []
        self.gone: dict[str, None] = {}  # the replicas last gone, oldest first (their late news is ignored)
        self.loads: dict[str, ReplicaLoad] = {}  # what this ingress sent each replica and it has not done
        self.foreign: dict[str, ReplicaLoad] = {}  # what other ingresses did, as the replica's last status told
        self.rates: dict[str, MeasuredRates] = {}  # how fast each replica works, as its counters measured
        self.measured: dict[str, ReplicaRates | None] = {}  # ... as of the last report
        self.typical_rates: ReplicaRates | None = None  # their mean: a replica not measured yet is taken to work so
        self.inflight: dict[str, InFlight] = {}  # by call key
        self.builds: dict[str, list[tuple[str, int]]] = {}  # call key -> (replica, tokens) others build for it
        self.reasons: dict[str, str] = {}  # call key -> why the router chose its replica, until it is routed
        self.counters: Counter[str] = Counter()
        self.lock = threading.Lock()

    def choose(self, request: RouteRequest, candidates: list[str], key: str | None = None) -> Decision:
        """The policy's pick among ``candidates``; with ``key``, its reason is kept for ``routed``."""
        with self.lock:
            decision = self.policy.choose(request, self.current_loads(candidates), self.index)
            if key is not None:
                self.reasons[key] = decision.reason
            return decision

    def routed(self, key: str, replica: str, request: RouteRequest, decode_tokens: int, reason: str | None = None,
               fetched: frozenset[str] = frozenset()) -> None:
        """Call ``key`` with ``request`` went to ``replica``: its cold tokens (what it holds and what is
        ``fetched`` for it left out) and decode budget count as that replica's load; it counts as
        routed for ``reason`` (None: the one ``choose`` kept, else "load")."""
        with self.lock:
            reason = self.reasons.pop(key, "load") if reason is None else reason
            holders = {document: self.index.holders(request.namespace, document) for document, _ in request.documents}
            cold = request.prompt_tokens - sum(t for document, t in request.documents
                                               if replica in holders[document] or document in fetched)
            load = self.loads.setdefault(replica, ReplicaLoad(replica))
            load.queued_prefill_tokens += cold
            load.running += 1
            load.decode_tokens += decode_tokens
            new = tuple(document for document in holders if replica not in self.index.held_by(request.namespace, document))
            self.index.pend(replica, request.namespace, new)
            self.inflight[key] = InFlight(replica, cold, decode_tokens, request.namespace, new)
            self.index.record_prefix(replica, request.token_ids, request.namespace)  # its private pool keeps it
            self.counters[f"routed_by_{reason}"] += 1

    def pools_filled(self, fills: dict[str, float]) -> None:
        """How full each replica's public pool is now (from its status)."""
        with self.lock:
            for replica, fill in fills.items():
                if replica not in self.gone:  # a status read before it died
                    self.loads.setdefault(replica, ReplicaLoad(replica)).pool_fill = min(1.0, fill)

    def current_loads(self, replicas: list[str]) -> list[ReplicaLoad]:
        """Each replica's load, in id order: what this ingress sent it, plus what other ingresses did
        (``loads_reported``), with its measured rates (``rates_reported``). Call under ``lock``."""
        loads = [self.loads.setdefault(r, ReplicaLoad(r)) for r in sorted(replicas)]
        for load in loads:
            if load.rates is None:  # a load made since the last report
                load.rates = self.measured.get(load.replica) or self.typical_rates
        return [load if load.replica not in self.foreign else with_added(load, self.foreign[load.replica])
                for load in loads]

    def loads_reported(self, reports: dict[str, dict[str, int]]) -> None:
        """Each replica's own count of its load (its status, once a second), where several ingresses
        share the replicas and each knows only what it sent: what a replica counts beyond what this
        ingress sent it is the others', added to this ingress's own count until the next report (a
        restarted ingress starts from the replicas' counts, not from zero)."""
        with self.lock:
            for replica, report in reports.items():
                if replica in self.gone:
                    continue
                own = self.loads.setdefault(replica, ReplicaLoad(replica))
                self.foreign[replica] = ReplicaLoad(
                    replica, max(0, report["queued_prefill_tokens"] - own.queued_prefill_tokens),
                    max(0, report["requests"] - own.running), max(0, report["decode_tokens"] - own.decode_tokens))

    def rates_reported(self, reports: dict[str, dict[str, Any]]) -> None:
        """Each replica's counters so far (its status's ``counters``, with its ``chunk_tokens``): its
        prefill passes, decode steps and fetches, read as rates (``MeasuredRates``) and given to its
        load; a replica not measured yet is taken to work at the mean of those measured (the replicas
        run one model)."""
        with self.lock:
            for replica, counters in reports.items():
                if replica not in self.gone:
                    self.rates.setdefault(replica, MeasuredRates()).update(counters)
            self.measured = {replica: rates.current() for replica, rates in self.rates.items()}
            self.typical_rates = mean_rates([rates for rates in self.measured.values() if rates is not None])
            for replica, load in self.loads.items():
                load.rates = self.measured.get(replica) or self.typical_rates

    def predicted_ttft(self, request: RouteRequest, candidates: list[str]) -> dict[str, float]:
        """Replica -> the seconds until ``request``'s first token there (``ttft_seconds``: the prefill
        queued on it and what it would prefill of this request, what it holds and can fetch priced as
        the policy does, and its decode steps meanwhile), at its measured rates (``current_loads``);
        empty until some replica has measured them."""
        with self.lock:
            loads = self.current_loads(candidates)
            if hasattr(self.policy, "predicted_ttft"):
                return self.policy.predicted_ttft(request, loads, self.index)
            tokens = self.policy.prefill_tokens(request, [load.replica for load in loads], self.index) \
                if hasattr(self.policy, "prefill_tokens") else {load.replica: float(request.prompt_tokens) for load in loads}
            return {load.replica: ttft_seconds(load, tokens[load.replica]) for load in loads if load.rates is not None}

    def predicted_tbt(self, candidates: list[str]) -> dict[str, float]:
        """Replica -> the seconds between two tokens of a request decoding there (``tbt_seconds``), for
        those with a decode step measured (or the mean of those measured)."""
        with self.lock:
            times = {load.replica: tbt_seconds(load) for load in self.current_loads(candidates)}
        return {replica: seconds for replica, seconds in times.items() if seconds is not None}

    def count(self, name: str, amount: int = 1) -> None:
        with self.lock:
            self.counters[name] += amount

    def building(self, key: str, replica: str, tokens: int) -> None:
        """``replica`` builds ``tokens`` of documents for call ``key``: load until its prefill is done."""
        with self.lock:
            self.loads.setdefault(replica, ReplicaLoad(replica)).queued_prefill_tokens += tokens
            self.builds.setdefault(key, []).append((replica, tokens))

    def prefilled(self, key: str) -> None:
        """Call ``key``'s prefill is done: its prefill tokens (its own, and those built for it elsewhere)
        leave the replicas' queues; it still runs and decodes there."""
        with self.lock:
            self._release_prefill(key)

    def finished(self, key: str) -> str | None:
        """Call ``key`` left its replica (which it names; None: it never reached one)."""
        with self.lock:
            self._release_prefill(key)
            self.reasons.pop(key, None)
            done = self.inflight.pop(key, None)
            if done is not None:
                self.index.unpend(done.replica, done.namespace, done.new_documents)
            load = self.loads.get(done.replica) if done is not None else None
            if load is not None:
                load.running -= 1
                load.decode_tokens -= done.decode_tokens
            return done.replica if done is not None else None

    def _release_prefill(self, key: str) -> None:
        for replica, tokens in self.builds.pop(key, []):
            if replica in self.loads:
                self.loads[replica].queued_prefill_tokens -= tokens
        done = self.inflight.get(key)
        if done is not None:
            if done.replica in self.loads:
                self.loads[done.replica].queued_prefill_tokens -= done.prefill_tokens
            done.prefill_tokens = 0

    def announce(self, announcement: Announcement) -> bool:
        """Apply a message of a replica's holdings stream (and how full its pool is: news as it
        happens, where its status comes once a second); False: it does not follow on, a dump is needed."""
        with self.lock:
            if announcement.replica in self.gone:
                return True  # late news of a replica already gone: nothing to keep
            if announcement.pool_fill is not None:
                load = self.loads.setdefault(announcement.replica, ReplicaLoad(announcement.replica))
                load.pool_fill = min(1.0, announcement.pool_fill)
            return self.index.apply(announcement)

    def set_replicas(self, replicas: list[str]) -> list[str]:
        """The replicas now running; those gone are forgotten (their documents, their load). Returns the new ones."""
        with self.lock:
            gone, new = set(self.replicas) - set(replicas), [r for r in replicas if r not in self.replicas]
            for replica in gone:
                log.warning("replica %s is gone: dropped from the document index", replica)
                self.index.forget(replica)
                self.loads.pop(replica, None)
                self.foreign.pop(replica, None)
                self.rates.pop(replica, None)
                self.gone[replica] = None
            for replica in new:
                self.gone.pop(replica, None)  # listed again (the router's list flapped): its news counts
                log.info("replica %s joined (%d serving)", replica, len(replicas))
            for replica in list(self.gone)[: max(0, len(self.gone) - GONE_KEPT)]:
                del self.gone[replica]  # long gone: no late news of it is still on its way
            self.replicas = sorted(replicas)
            return new


@dataclass
class MeasuredRate:
    """A rate read from a replica's counters (an amount done, the seconds it took): the mean over its
    first report, then moved a third of the way to each later report's rate (over at least
    ``MIN_SECONDS`` more)."""

    amount: float = 0
    seconds: float = 0.0
    per_s: float | None = None

    MIN_SECONDS = 0.2  # less time than this between two reports says too little of the rate
    WEIGHT = 1 / 3

    def update(self, amount: float, seconds: float) -> None:
        if amount < self.amount or seconds < self.seconds:  # a replaced replica counts from zero
            self.amount = self.seconds = 0
        worked = seconds - self.seconds
        if worked >= self.MIN_SECONDS:
            rate = (amount - self.amount) / worked
            self.per_s = rate if self.per_s is None else self.per_s + self.WEIGHT * (rate - self.per_s)
            self.amount, self.seconds = amount, seconds


@dataclass
class MeasuredRates:
    """A replica's rates from its counters: prompt tokens its prefill passes computed a second, decode
    steps a second, document tokens a second that reached it from other replicas' pools."""

    prefill: MeasuredRate = field(default_factory=MeasuredRate)
    decode: MeasuredRate = field(default_factory=MeasuredRate)
    fetch: MeasuredRate = field(default_factory=MeasuredRate)
    chunk_tokens: int | None = None

    def update(self, counters: dict[str, Any]) -> None:
        if "pass_tokens" in counters:
            self.prefill.update(counters["pass_tokens"], counters["pass_seconds"])
        if "decode_steps" in counters:
            self.decode.update(counters["decode_steps"], counters["decode_seconds"])
        if "fetched_tokens" in counters:
            self.fetch.update(counters["fetched_tokens"], counters["fetch_wait_seconds"])
        self.chunk_tokens = counters.get("chunk_tokens", self.chunk_tokens)

    def current(self) -> ReplicaRates | None:
        """The rates as measured so far; None until its prefill rate is."""
        if not self.prefill.per_s:
            return None
        return ReplicaRates(self.prefill.per_s, 1.0 / self.decode.per_s if self.decode.per_s else None,
                            self.fetch.per_s or None, self.chunk_tokens)


def mean_rates(measured: list[ReplicaRates]) -> ReplicaRates | None:
    """The mean of each rate over the replicas that measured it (None: none measured a prefill rate)."""
    if not measured:
        return None
    chunk = _mean([rates.chunk_tokens for rates in measured])
    return ReplicaRates(_mean([rates.prefill_tokens_per_s for rates in measured]),
                        _mean([rates.decode_step_s for rates in measured]),
                        _mean([rates.fetch_tokens_per_s for rates in measured]), None if chunk is None else round(chunk))


def _mean(values: list[Any]) -> Any:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


def with_added(load: ReplicaLoad, other: ReplicaLoad) -> ReplicaLoad:
    """``load`` with ``other``'s work added (its pool fill kept)."""
    return replace(load, queued_prefill_tokens=load.queued_prefill_tokens + other.queued_prefill_tokens,
                   running=load.running + other.running, decode_tokens=load.decode_tokens + other.decode_tokens)


_states: dict[str, ClusterState] = {}


def register_state(name: str, state: ClusterState) -> None:
    _states[name] = state


def state_named(name: str) -> ClusterState | None:
    return _states.get(name)
