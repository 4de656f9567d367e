"""One request's dispatch plan: the combine node, the cold documents each worker prefills (LPT),
and the warm entries the combine node pulls from peers."""
from dataclasses import dataclass, field

from hypic.cache.plan import RequestPlan
from hypic.prefill_stats import BuiltForRequest

from .index import SegmentIndex
from .lpt import least_queued, spread_builds

# a request's builds on one worker carry its priority plus this per place in prompt order: they run
# in that order (what the combine node combines early) whatever order Ray's threads queue them in,
# up to 0.25 s of wait-credit jitter
PROMPT_ORDER_TOKENS = 64.0


@dataclass(frozen=True)
class SegmentJob:
    """A document interior the request splices: its public-pool key, its token ids and the cache
    namespace it is keyed in (a builder checks the key against both)."""

    key: str
    token_ids: tuple[int, ...]
    namespace: str = ""

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


def document_jobs(request: RequestPlan) -> list[SegmentJob]:
    """The documents a planned request splices from the public pool, as the plan keys them."""
    return [SegmentJob(key, ids, request.policy.namespace) for _, key, ids in request.documents()]


@dataclass
class Plan:
    """``builds``: worker -> cold documents it prefills alone and ships to ``combine``;
    ``pulls``: holder -> keys the combine node fetches from it."""

    combine: int
    builds: dict[int, list[SegmentJob]] = field(default_factory=dict)
    pulls: dict[int, list[str]] = field(default_factory=dict)

    def arriving_at(self, worker: int) -> frozenset[str]:
        """Keys of the documents ``worker`` gets from others: built or held elsewhere."""
        built = {job.key for other, jobs in self.builds.items() if other != worker for job in jobs}
        return frozenset(built.union(*(keys for other, keys in self.pulls.items() if other != worker)))

    def build_tokens(self) -> dict[int, int]:
        return {worker: sum(job.tokens for job in jobs) for worker, jobs in self.builds.items()}

    def built_for_request(self, home: int) -> BuiltForRequest:
        """What this plan builds for its request (misses wherever they are built); remote: off ``home``
        (each counted once its entry is taken from ``home``'s pool, see ``BuiltForRequest``)."""
        remote = tuple((job.key, job.tokens) for worker, jobs in self.builds.items() if worker != home for job in jobs)
        return BuiltForRequest(frozenset(job.key for jobs in self.builds.values() for job in jobs), remote)


MATCH_WEIGHT = 2.0  # how much a cached fraction of the request outweighs a normalised load


def combine_score(held: int, total: int, load: int, max_load: int, match_weight: float = MATCH_WEIGHT) -> float:
    """A worker's fitness as a request's combine node (cache-aware routing): match weight x
    the fraction of the request's ``total`` document tokens it holds, less its normalised load (its
    queued tokens over the busiest worker's plus this request's, in [0, 1))."""
    return match_weight * held / max(total, 1) - load / max(max_load + total, 1)


def make_plan(jobs: list[SegmentJob], index: SegmentIndex, loads: dict[int, int], combine: int | None = None,
              match_weight: float = MATCH_WEIGHT, prefixes: dict[int, int] | None = None,
              prompt_tokens: int = 0, combine_tokens: int = 0) -> Plan:
    """The combine node (unless given) has the best ``combine_score`` (ties: the lowest id), what a
    worker holds being its cached documents, or the prompt prefix it is believed to hold
    (``prefixes``: worker -> tokens) if more; a prompt without documents is scored over its
    ``prompt_tokens``. Documents no live worker holds are spread by LPT over every worker, counting
    the tokens each already has queued (``loads``, live workers only) and, on the combine node, the
    request's own combine pass (``combine_tokens``): it builds less, and can combine the prompt's
    head while its peers' last documents are still on their way."""
    if not loads or (combine is not None and combine not in loads):
        raise ValueError("no live workers" if not loads else f"combine node {combine} is not live")
    unique = list({job.key: job for job in jobs}.values())
    live = set(loads)
    holders = {job.key: index.holders(job.key) & live for job in unique}
    held = {w: sum(job.tokens for job in unique if w in holders[job.key]) for w in loads}
    total = sum(job.tokens for job in unique) or prompt_tokens
    held = {w: min(total, max(tokens, (prefixes or {}).get(w, 0))) for w, tokens in held.items()}
    if combine is None:
        busiest = max(loads.values())
        combine = min(loads, key=lambda w: (-combine_score(held[w], total, loads[w], busiest, match_weight), w))
    plan = Plan(combine)
    cold = [job for job in unique if not holders[job.key]]
    shares = spread_builds([job.tokens for job in cold], {w: loads[w] for w in sorted(loads)}, combine, combine_tokens)
    plan.builds.update({worker: [cold[i] for i in indices] for worker, indices in shares.items()})
    for job in unique:
        if holders[job.key] and combine not in holders[job.key]:
            plan.pulls.setdefault(least_queued(holders[job.key], loads), []).append(job.key)
    return plan
