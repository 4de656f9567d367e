"""A request's prefill worked out once (``Engine.plan``), and passed to everything that needs it.

What a prefill reuses is a function of its parts, its mode and the engine's seam rule: which
segments it splices, the layout marks that key its private-pool states, the key of its prompt in
the private pool, and the public-pool key of every spliced segment. The serving loop ranks a
request by it, prefetches its documents from lower tiers by it and prefills by it; none of them
hashes the prompt again.
"""
from dataclasses import dataclass, field

from .modes import ModePolicy
from .prefix_cache import cache_key
from .segments import PromptParts, Seams, layout_marks, spliceable
from .store import entry_key


@dataclass(frozen=True)
class RequestPlan:
    """``parts`` under ``policy``: ``spliced`` segment indices (their interiors come from the public
    pool), each one's public-pool key (``entry_keys``), the layout ``marks`` (position -> PartMark
    bits) and the private-pool key of the ids up to ``exact_from`` inclusive (``tree_key``: ids with
    their marks). ``logits_from``: the first position whose logits the request needs (input
    logprobs); nothing from there on is spliced or resumed."""

    parts: PromptParts
    policy: ModePolicy
    spliced: tuple[int, ...]
    entry_keys: dict[int, str] = field(repr=False)
    marks: dict[int, int] = field(repr=False)
    tree_key: list[int] = field(repr=False)
    logits_from: int | None = None

    @property
    def exact_from(self) -> int:
        """The first position computed exactly (the prompt's length when no logits are asked for)."""
        return len(self.parts.token_ids) if self.logits_from is None else self.logits_from

    def interior_tokens(self, index: int) -> int:
        """The interior length of spliced segment ``index`` (what splicing it saves)."""
        assert self.policy.seams is not None
        lo, hi = self.policy.seams.interior(len(self.parts.segments[index])) or (0, 0)
        return hi - lo

    def recomputed_tokens(self) -> int:
        """The tokens its combine pass computes once every spliced interior is cached: the prompt less
        those interiors (what a combine node's load counts for it)."""
        return len(self.parts.token_ids) - sum(self.interior_tokens(i) for i in self.spliced)

    def head(self, segments: int) -> "RequestPlan":
        """The plan of this prompt cut after its first ``segments`` segments (no query): what an early
        combine of a held head runs. Its documents keep this plan's keys (nothing is hashed again)."""
        parts = self.parts
        head = PromptParts(parts.leading, parts.segments[:segments], (), parts.namespace)
        spliced = spliced_segments(head, self.policy.seams, len(head.token_ids))
        marks = layout_marks(head, spliced)
        keys = {i: self.entry_keys[i] for i in spliced}
        return RequestPlan(head, self.policy, tuple(spliced), keys, marks, cache_key(list(head.token_ids), marks))

    def documents(self) -> list[tuple[int, str, tuple[int, ...]]]:
        """(segment index, public-pool key, token ids) of each spliced segment, in prompt order."""
        return [(i, self.entry_keys[i], self.parts.segments[i]) for i in self.spliced]


def spliced_segments(parts: PromptParts, seams: Seams | None, exact_from: int) -> list[int]:
    """The segments whose interiors are spliced under ``seams`` (None: none), keeping positions from
    ``exact_from`` on recomputed."""
    if seams is None:
        return []
    ends = {i: begin + (seams.interior(len(segment)) or (0, 0))[1]
            for i, (segment, begin) in enumerate(zip(parts.segments, parts.segment_starts))}
    return [i for i in spliceable(parts, seams) if ends[i] <= exact_from]


def plan_request(parts: PromptParts, policy: ModePolicy, fingerprint: str,
                 logits_from: int | None = None) -> RequestPlan:
    """The ``RequestPlan`` of ``parts`` under ``policy`` (already scoped to the request's namespace)
    for the model of ``fingerprint``: what an engine and a router both go by."""
    ids = parts.token_ids
    exact_from = len(ids) if logits_from is None else logits_from
    spliced = spliced_segments(parts, policy.seams, exact_from)
    marks = layout_marks(parts, spliced)
    keys = {i: entry_key(fingerprint, policy.seams, policy.role, parts.segments[i], policy.namespace)  # type: ignore[arg-type]
            for i in spliced}
    return RequestPlan(parts, policy, tuple(spliced), keys, marks, cache_key(ids[: exact_from + 1], marks), logits_from)
