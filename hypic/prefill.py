"""A planned request's prefill: what it reuses comes from the caches, what it computes from the model
runner, and what it made goes back into the caches.

``Prefiller.prefill_steps`` is the whole path of one request after planning: match its prefix (the
state it resumes from) and its documents (each pinned while the request reads it; one missing is
built alone and offered to the public pool), lay the prompt out around them, run the combine pass
in chunks, keep its states in the private pool. Everything is ``Steps``: the serving loop batches
the passes of many requests; ``drain`` runs one alone.
"""
import logging
import time
from collections import Counter
from dataclasses import dataclass, replace

import torch

from .assembler import Steps
from .cache.hybrid_cache import HybridCache
from .cache.modes import ModePolicy
from .cache.plan import RequestPlan
from .cache.segments import Run, build_layout
from .cache.store import SegmentEntry
from .model_runner import ModelRunner
from .prefill_stats import BuiltForRequest, PrefillStats, Reuse
from .state import RequestState

log = logging.getLogger("hypic")
BUILD_WAIT_S = 600.0  # a request waits this long for another's build of a document it needs, then builds it too


@dataclass
class Prefill:
    """A prefilled request: first-token logits [vocab] and the state decode continues from; with
    ``logits_from`` p, ``prompt_logits`` [len - p, vocab] holds the logits at positions p.. (the
    distribution of each next prompt token: input logprobs). ``reuse``: what the prefill found;
    ``built``: what was done for the request before it (set by whoever knows: ``for_request``)."""

    logits: torch.Tensor
    state: RequestState
    reuse: Reuse
    prompt_logits: torch.Tensor | None = None
    built: BuiltForRequest = BuiltForRequest()

    @property
    def stats(self) -> PrefillStats:
        """What the request reused and recomputed, counted as its client experienced it."""
        return self.reuse.stats(self.built)

    def for_request(self, built: BuiltForRequest) -> "Prefill":
        """This prefill, counted for a request for which ``built`` was done beforehand."""
        return replace(self, built=built)


class Prefiller:
    """Prefills against ``cache`` with ``runner``'s passes."""

    def __init__(self, cache: HybridCache, runner: ModelRunner) -> None:
        self.cache, self.runner = cache, runner
        self.building: Counter[str] = Counter()  # documents being built for this engine's pool, by key

    def document_steps(self, key: str, token_ids: tuple[int, ...], policy: ModePolicy,
                       keep: bool = True) -> Steps[SegmentEntry]:
        """Build a document's entry alone and offer it to the public pool; returns the pool's copy
        (or the entry, if it did not fit). ``keep=False``: built for someone else, not offered.
        While it is built, other requests that need it wait for it (``_built_elsewhere``)."""
        if not keep:
            return (yield from self.runner.entry_steps(key, token_ids, policy))
        self.building[key] += 1
        try:
            entry = yield from self.runner.entry_steps(key, token_ids, policy)
        finally:
            self.building[key] -= 1
            if not self.building[key]:
                del self.building[key]
        return self.cache.insert_document(entry)

    def _built_elsewhere(self, key: str) -> Steps[None]:
        """Pauses, a turn at a time, while another request's steps build ``key`` for the pool (two
        requests for one new document build it once); past ``BUILD_WAIT_S`` the caller builds it too."""
        deadline = time.monotonic() + BUILD_WAIT_S
        while key in self.building:
            if time.monotonic() > deadline:
                log.warning("document %s was still being built after %.0f s: built again for another request",
                            key[:16], BUILD_WAIT_S)
                return
            yield None

    def documents_steps(self, policy: ModePolicy, documents: list[tuple[int, ...]]) -> Steps[list[int]]:
        """Cache each tokenized document memory lacks (those too short to have an interior are
        skipped); returns each one's token count."""
        for ids in documents:
            if policy.seams is not None and policy.seams.interior(len(ids)) is not None:
                entry, key = self.cache.lookup_document(ids, policy)
                if entry is None and key in self.building:
                    yield from self._built_elsewhere(key)
                    entry, key = self.cache.lookup_document(ids, policy)
                if entry is None:
                    yield from self.document_steps(key, ids, policy)
        return [len(ids) for ids in documents]

    def _entries(self, plan: RequestPlan, indices: list[int], found: list[tuple[str, int, str | None]],
                 pinned: list[str]) -> Steps[dict[int, SegmentEntry]]:
        """The entry of each document in ``indices``: found (in memory or below) or built here; each
        recorded in ``found`` (key, tokens, tier or None: built) and pinned, its key in ``pinned``,
        before any yield: other requests' inserts must not evict it."""
        entries: dict[int, SegmentEntry] = {}
        for index in indices:
            segment, key = plan.parts.segments[index], plan.entry_keys[index]
            entry, tier = self.cache.match_document(key, segment, plan.policy.namespace)
            if entry is None and key in self.building:
                yield from self._built_elsewhere(key)
                entry, tier = self.cache.match_document(key, segment, plan.policy.namespace)
            pinned.append(key)
            if entry is None:
                entry, tier = (yield from self.document_steps(key, segment, plan.policy)), None
            entries[index] = entry
            found.append((key, entry.length, tier))
        return entries

    def prefill_steps(self, plan: RequestPlan, snapshot_end: bool = False) -> Steps[Prefill]:
        """Prefill a planned request: one ``CombineWork`` per chunk (of a missing document's build or
        of the combine pass); returns the ``Prefill``, with the logits of every position from
        ``plan.logits_from`` on if it asks for them (computed exactly), and what it reused.
        ``snapshot_end``: the private pool also keeps the state at the prompt's end (a head combined
        early: its request resumes there). Documents stay pinned until the combine pass is done.
        Everything it reuses or keeps is in the plan's namespace."""
        parts, ids = plan.parts, plan.parts.token_ids
        init, resumed = self.cache.match_prefix(plan)
        after_resume = [i for i in plan.spliced if parts.segment_starts[i] >= init.length]
        pinned: list[str] = []
        found: list[tuple[str, int, str | None]] = []
        try:
            entries = yield from self._entries(plan, after_resume, found, pinned)
            pieces = build_layout(parts, plan.policy.seams, set(entries), init.length)
            snapshot_at = self.cache.snapshot_positions(plan, init.length, snapshot_end)
            result = yield from self.runner.combine_steps(ids, pieces, init, entries, plan.policy, snapshot_at,
                                                          plan.logits_from)
        finally:
            self.cache.unpin(pinned)
        result.state.marks = plan.marks
        self.cache.insert_prefix(plan, result.state, result.snapshots)
        assert result.logits is not None
        reuse = Reuse(len(ids), resumed, tuple(found), sum(p.length for p in pieces if isinstance(p, Run)))
        return Prefill(result.logits, result.state, reuse, result.row_logits)

    def precombine_steps(self, plan: RequestPlan, built: BuiltForRequest = BuiltForRequest(),
                         arriving: frozenset[str] = frozenset()) -> Steps[PrefillStats | None]:
        """The combine pass over the head of ``plan`` whose documents memory holds (``held_head``:
        chosen at the first step, documents keyed in ``arriving`` left out), its end kept in the
        private pool, so the whole request later resumes there; returns the head's stats (None:
        nothing to run)."""
        head = self.cache.held_head(plan, arriving)
        if head is None:
            return None
        prefill = yield from self.prefill_steps(head, snapshot_end=True)
        return prefill.reuse.stats(built)
