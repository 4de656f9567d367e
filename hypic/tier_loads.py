"""Reads from the tiers below memory, started as a request arrives so its prefill need not wait:
the documents it splices that only the disk or Mooncake holds, and its resume point there; and how
much of its prompt is left to compute given everything cached (the scheduler's size of a request)."""
from collections.abc import Callable

from .cache.plan import RequestPlan
from .cache.store import Load, SegmentStore
from .resume_points import ResumePoints


class TierLoads:
    """The public pool's lower-tier reads and the private pool's resume-point reads for planned
    requests. ``store``: the public pool (its ``lower`` tiers, if any); ``entry_bytes(tokens, mode)``:
    the bytes of a document's entry (what a prefetch expects to read)."""

    def __init__(self, store: SegmentStore, resume_points: ResumePoints,
                 entry_bytes: Callable[[int, str], int]) -> None:
        self.store, self.resume_points, self.entry_bytes = store, resume_points, entry_bytes

    def _not_in_memory(self, plan: RequestPlan) -> list[tuple[str, tuple[int, ...]]]:
        """(key, token ids) of each document ``plan`` splices that memory lacks, when there are lower
        tiers to look in (else none)."""
        if self.store.lower is None:
            return []
        return [(key, ids) for _, key, ids in plan.documents() if self.store.peek(key, ids) is None]

    def prefetch(self, plan: RequestPlan) -> list[Load]:
        """Start loading, from the lower tiers, the documents ``plan`` splices that memory lacks, and
        looking for a resume point longer than memory's (a serving loop calls this as the request
        arrives); returns those loads, each with until when its request is held back for it (the
        prefetch policy's wait for a document, ``resume.LOOKUP_WAIT_S`` for the resume point)."""
        loads = [self.store.lower.prefetch(key, ids, plan.policy.namespace,  # type: ignore[union-attr]
                                           self.entry_bytes(len(ids), plan.policy.name))
                 for key, ids in self._not_in_memory(plan)]
        loads.append(self.resume_points.prefetch(plan))
        return [load for load in loads if load is not None]

    def discard_prefetch(self, plan: RequestPlan) -> None:
        """Drop what ``prefetch`` read for ``plan``'s resume point (its request went away unserved)."""
        self.resume_points.discard_prefetch(plan)

    def load_from_tiers(self, plan: RequestPlan) -> tuple[tuple[str, str], ...]:
        """Bring the documents ``plan`` splices that only a lower tier holds into memory now (a router
        plans with what memory holds); returns (key, tier) of each loaded."""
        found = [(key, self.store.fetch(key, ids, plan.policy.namespace)) for key, ids in self._not_in_memory(plan)]
        return tuple((key, tier) for key, (entry, tier) in found if entry is not None)

    def uncached_tokens(self, plan: RequestPlan) -> int:
        """About how many prompt tokens ``plan``'s prefill would compute now: the prompt less its
        cached interiors (in memory, or in a lower tier's local index: the disk's) and its
        private-pool prefix (the scheduler's size of a request)."""
        total, cached, lower = len(plan.parts.token_ids), 0, self.store.lower
        for index, key, ids in plan.documents():
            entry = self.store.peek(key, ids)
            if entry is not None:
                cached += entry.length
            elif lower is not None and lower.indexed(key, plan.policy.namespace):
                cached += plan.interior_tokens(index)
        if plan.policy.tree is not None:
            cached += self.resume_points.pool.peek(plan.policy.tree, plan.tree_key, total - 1)
        return max(1, total - cached)
