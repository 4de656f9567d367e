"""STUB (replaced by the real policies at merge)."""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouteRequest:
    namespace: str
    documents: tuple[tuple[str, int], ...]
    prompt_tokens: int
    token_ids: tuple[int, ...] = ()


@dataclass
class ReplicaLoad:
    replica: str
    queued_prefill_tokens: int = 0
    running: int = 0
    decode_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str
    costs: dict = field(default_factory=dict)


POLICIES = ("cache_aware", "round_robin", "power_of_two", "prefix")


class _CacheAware:
    name = "cache_aware"

    def choose(self, request, loads, index):
        costs = {}
        for load in loads:
            missing = sum(t for k, t in request.documents if load.replica not in index.holders(request.namespace, k))
            costs[load.replica] = missing + load.queued_prefill_tokens
        best = min(loads, key=lambda l: (costs[l.replica], l.running, l.replica))
        return Decision(best.replica, "cache", costs)


def policy_named(name: str, **options):
    return _CacheAware()


def spread_documents(tokens, loads):
    return [loads[i % len(loads)].replica for i in range(len(tokens))]


RoutingPolicy = _CacheAware
