"""What a request's prefill reused, counted as the client experienced it.

A prefill only records what it found (``Reuse``: where its resume point and each document came
from, what it computed). The counts are derived from that once, at the end, together with what
was done for the request beforehand (``BuiltForRequest``): a document built for the request (by
this engine or by a peer, before its combine pass) is a miss even once it sits in the public pool,
and a head of its prompt combined early is no private-pool hit: only what existed before the
request arrived counts as cached.
"""
from dataclasses import dataclass, fields, replace


@dataclass
class PrefillStats:
    """What the prefill of one request reused and recomputed."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    segments_hit: int = 0
    segments_missed: int = 0
    combine_tokens: int = 0  # tokens run in the combine pass (seams, Q, unspliced segments)
    prefix_hit_tokens: int = 0  # leading tokens resumed from the private pool (prefix cache)
    segments_built_remotely: int = 0  # of the missed, those a peer worker built and the prefill took from the pool
    remote_prefill_tokens: int = 0  # the tokens of those documents
    combined_early_tokens: int = 0  # the head of the prompt combined while its documents were still arriving
    disk_cached_tokens: int = 0  # of cached_tokens, those of documents loaded from the disk tier
    mooncake_cached_tokens: int = 0  # ... and from Mooncake Store
    host_cached_tokens: int = 0  # ... and from host memory below a GPU's pool (L2)
    segments_fetched: int = 0  # of the hit, those fetched from another replica's pool for this request
    replica_cached_tokens: int = 0  # ... their tokens

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Where the reused tokens came from: memory (``device``; host memory on a CPU server), host
        memory below a GPU's pool, the disk, Mooncake, another replica's pool."""
        lower = self.disk_cached_tokens + self.mooncake_cached_tokens + self.host_cached_tokens + self.replica_cached_tokens
        return {"device": self.cached_tokens - lower, "host": self.host_cached_tokens, "disk": self.disk_cached_tokens,
                "mooncake": self.mooncake_cached_tokens, "replica": self.replica_cached_tokens}

    def count_hit(self, tokens: int, tier: str) -> None:
        """A document of ``tokens`` cached tokens reused from ``tier`` ("replica": fetched from another
        replica's pool for this request)."""
        self.segments_hit += 1
        self.cached_tokens += tokens
        if tier in ("disk", "mooncake", "host", "replica"):
            setattr(self, f"{tier}_cached_tokens", getattr(self, f"{tier}_cached_tokens") + tokens)
        self.segments_fetched += tier == "replica"

    @property
    def recomputed_tokens(self) -> int:
        """Every prompt token whose state was computed for this request."""
        return self.prompt_tokens - self.cached_tokens

    def add(self, other: "PrefillStats") -> None:
        """Add ``other``'s counts to these (totals over requests)."""
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def resume_at_head(self, head: "PrefillStats") -> None:
        """Count a resume at the end of ``head`` (a head of this prompt combined early for this
        request) as that head's own reuse, not as a private-pool hit of its length."""
        self.cached_tokens += head.cached_tokens
        self.disk_cached_tokens += head.disk_cached_tokens
        self.mooncake_cached_tokens += head.mooncake_cached_tokens
        self.host_cached_tokens += head.host_cached_tokens
        self.replica_cached_tokens += head.replica_cached_tokens
        self.segments_fetched += head.segments_fetched
        self.prefix_hit_tokens = head.prefix_hit_tokens
        self.combined_early_tokens = head.prompt_tokens
        self.segments_hit += head.segments_hit
        self.segments_missed += head.segments_missed
        self.segments_built_remotely += head.segments_built_remotely
        self.remote_prefill_tokens += head.remote_prefill_tokens
        self.combine_tokens += head.combine_tokens


@dataclass(frozen=True)
class BuiltForRequest:
    """Work done for one request before its combine pass: the public-pool keys of the documents
    built for it (anywhere), the (key, tokens) of those a peer was to build (``remote``: one counts
    as built remotely only if its entry arrived and the prefill took it from the pool; one whose
    build or transfer failed is recomputed and is not), and the heads of its prompt combined early
    (their stats, shortest first)."""

    keys: frozenset[str] = frozenset()
    remote: tuple[tuple[str, int], ...] = ()
    heads: tuple[PrefillStats, ...] = ()
    loaded: tuple[tuple[str, str], ...] = ()  # (key, tier) of documents brought up from a lower tier for it

    def with_head(self, head: PrefillStats | None) -> "BuiltForRequest":
        """This record with one more head combined early (None: nothing was combined)."""
        if head is None:
            return self
        return replace(self, heads=(*self.heads, head))

    def tier_of(self, key: str, tier: str) -> str:
        """Where the document ``key``, found in ``tier``, came from for this request (a lower tier
        if it was loaded into memory for it before its prefill)."""
        return dict(self.loaded).get(key, tier)

    def head_ending_at(self, tokens: int) -> PrefillStats | None:
        """The early-combined head of ``tokens`` tokens, if any (a resume there was made for this request)."""
        return next((head for head in reversed(self.heads) if head.prompt_tokens == tokens), None)


@dataclass(frozen=True)
class Reuse:
    """What one prefill found and did, before any accounting: the private-pool resume point it
    started from (``resumed``: its tokens and the tier it came from, ``device`` for memory), each
    spliced document it used (``documents``: key, interior tokens, the tier it was found in, or None
    when this prefill built it), and the tokens its combine pass computed."""

    prompt_tokens: int = 0
    resumed: tuple[int, str] | None = None
    documents: tuple[tuple[str, int, str | None], ...] = ()
    combine_tokens: int = 0

    def stats(self, built: BuiltForRequest = BuiltForRequest()) -> PrefillStats:
        """The request's counts: this reuse, less what was ``built`` for the request beforehand."""
        stats, remote = PrefillStats(prompt_tokens=self.prompt_tokens), dict(built.remote)
        if self.resumed is not None:
            _count_resume(stats, *self.resumed, built)
        for key, tokens, tier in self.documents:
            if tier is None or key in built.keys:
                stats.segments_missed += 1
            else:
                stats.count_hit(tokens, built.tier_of(key, tier))
            if tier is not None and key in remote:  # a peer's entry, taken from the pool
                stats.segments_built_remotely += 1
                stats.remote_prefill_tokens += remote[key]
        stats.combine_tokens += self.combine_tokens
        return stats


def _count_resume(stats: PrefillStats, tokens: int, tier: str, built: BuiltForRequest) -> None:
    """A resume at ``tokens``: the reuse of a head combined early for the request, else a prefix hit."""
    if tier in ("disk", "mooncake"):
        setattr(stats, f"{tier}_cached_tokens", getattr(stats, f"{tier}_cached_tokens") + tokens)
    head = built.head_ending_at(tokens)
    if head is not None:
        stats.resume_at_head(head)
    else:
        stats.cached_tokens += tokens
        stats.prefix_hit_tokens = tokens
