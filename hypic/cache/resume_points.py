"""The private pool's resume points: the prefix cache in memory and, below it, the resume store on
disk and in Mooncake, kept in step. What memory makes, resumes from or drops is offered below (as
the write policy wants it); what only a lower tier holds is brought into memory when a request
resumes from it."""
from collections.abc import Callable
from typing import Any

from .modes import ModePolicy, tree_namespace
from .plan import RequestPlan
from .prefix_cache import PrefixCache, PrefixHit, RadixNode
from .segments import PromptParts, document_boundaries
from .store import Event, Load
from .tiers.hierarchy import WritePolicy
from .tiers.resume import ResumeFound, ResumeStore
from ..parallel.group import TensorParallel, rank_extremes
from ..state import RequestState


class ResumePoints:
    """Where a request's prefill starts, and which of its states are kept to start later ones from.
    ``pool``: the private pool in memory; ``store``: its resume points on disk and in Mooncake
    (None: memory only); ``snapshot_interval``: tokens between kept states (0: off);
    ``empty_state``: a state of no tokens on the model's device (what hits are assembled on);
    ``tp``: the tensor-parallel group whose ranks must resume alike."""

    def __init__(self, pool: PrefixCache, store: ResumeStore | None, snapshot_interval: int,
                 empty_state: Callable[[], RequestState], tp: TensorParallel = TensorParallel()) -> None:
        self.pool, self.store, self.snapshot_interval = pool, store, snapshot_interval
        self.empty_state, self.tp = empty_state, tp
        if store is not None and store.write_policy is WritePolicy.WRITE_BACK:
            pool.on_drop = self.dropped  # write_back writes a resume point as memory lets go of it

    def resume_state(self, key: list[int], policy: ModePolicy) -> tuple[RequestState, tuple[int, str] | None]:
        """The longest private-pool hit (never the whole prompt: the last token must be run), in
        memory or, past it, among the resume points kept on disk or in Mooncake, and where it came
        from (its tokens and tier: ``device``, ``disk`` or ``mooncake``; None: no hit)."""
        empty = self.empty_state()
        if policy.tree is None:
            return empty, None
        hit = self.pool.match(policy.tree, key, len(key) - 1, empty)
        kept = self._from_lower_tiers(key, policy, hit.length if hit is not None else 0, empty)
        if kept is not None:
            hit, found_in = kept
            return hit.state, (hit.length, "mooncake" if found_in == "mooncake" else "disk")
        if hit is None:
            return empty, None
        self.keep(policy.tree, policy.namespace, hit.state, hit.length, hit.snapshot, Event.HIT)  # write_through_selective's moment
        return hit.state, (hit.length, "device")

    def _from_lower_tiers(self, key: list[int], policy: ModePolicy, after: int,
                          empty: RequestState) -> tuple[PrefixHit, str] | None:
        """A resume point on disk or in Mooncake longer than ``after`` (memory's), brought into the
        private pool (a later request finds it in memory) and handed out as a hit, with the name of
        the tier it came from; None if there is none."""
        if self.store is None or policy.tree is None:
            return None
        found = self.store.take(policy.tree, policy.namespace, key, after, len(key) - 1, empty)
        if not self._every_rank_found(found):
            return None
        state = found.state
        self.pool.insert(policy.tree, state, {state.length: found.snapshot})
        hit = self.pool.match(policy.tree, key, state.length, empty)
        return (hit if hit is not None and hit.length == state.length else PrefixHit(state.length, state)), found.tier

    def _every_rank_found(self, found: ResumeFound | None) -> bool:
        """Whether every tensor-parallel rank found its shard of the same resume point (same length);
        else each resumes from memory's, alike."""
        length = found.state.length if found is not None else 0
        low, high = rank_extremes([length], self.tp, "a resume point's length")
        return found is not None and low == high

    def prefetch(self, plan: RequestPlan) -> Load | None:
        """Start looking, on disk and in Mooncake, for a resume point of ``plan`` longer than memory's
        (None: no tier below memory, or its mode keeps no states)."""
        tree = plan.policy.tree
        if self.store is None or tree is None:
            return None
        key = plan.tree_key
        after = self.pool.peek(tree, key, len(key) - 1)
        return self.store.prefetch(tree, plan.policy.namespace, key, after, len(key) - 1, self.empty_state())

    def discard_prefetch(self, plan: RequestPlan) -> None:
        """Drop what ``prefetch`` read for ``plan`` (its request went away unserved)."""
        if self.store is not None and plan.policy.tree is not None:
            self.store.discard(plan.policy.tree, plan.policy.namespace, plan.tree_key)

    def dropped(self, tree: str, node: RadixNode, event: Event = Event.EVICTED) -> None:
        """A private-pool resume point leaves memory (evicted, or the server stops): offered to the
        tiers below (``write_back`` writes it)."""
        if self.store is None or not self.store.wanted(event) or node.snapshot is None:
            return
        state = self.pool.state_at(node, self.empty_state())
        self.keep(tree, tree_namespace(tree), state, node.depth, node.snapshot, event)

    def keep(self, tree: str, namespace: str, state: RequestState, position: int,
             snapshot: dict[int, Any], event: Event = Event.MADE) -> None:
        """Offer the state after ``position`` tokens to the disk and Mooncake as a resume point (if
        either is there)."""
        if self.store is not None and 0 < position <= state.length:
            self.store.offer(tree, namespace, state, position, snapshot, event)

    def snapshot_positions(self, parts: PromptParts, start: int, end: bool = False) -> list[int]:
        """Where the private pool keeps this prompt's linear states (after ``start``): at document
        edges, every ``snapshot_interval`` tokens (shared system prompts), before the last token
        (the same prompt sent again recomputes only that token), and with ``end`` at its end.
        Positions inside a spliced interior have no state and are skipped by the combine pass."""
        total = len(parts.token_ids)
        points = {*document_boundaries(parts), total - 1, *([total] if end else [])}
        if self.snapshot_interval:
            points.update(range(self.snapshot_interval, total, self.snapshot_interval))
        return sorted(p for p in points if start < p <= total)

    def close(self) -> None:
        """Offer memory's resume points below one last time (write_back's moment) and finish the
        writes under way."""
        if self.store is None:
            return
        if self.store.wanted(Event.CLOSING):
            for tree, node in self.pool.resume_points():
                self.dropped(tree, node, Event.CLOSING)
        self.store.close()
