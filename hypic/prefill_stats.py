"""What a request's prefill reused, counted as the client experienced it.

A document built for the request (by this engine or by a peer, before its combine pass) is a
miss even once it sits in the public pool, and a head of its prompt combined early is no
private-pool hit: only what existed before the request arrived counts as cached.
"""
from dataclasses import dataclass, fields


@dataclass
class PrefillStats:
    """What the prefill of one request reused and recomputed."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    segments_hit: int = 0
    segments_missed: int = 0
    combine_tokens: int = 0  # tokens run in the combine pass (seams, Q, unspliced segments)
    prefix_hit_tokens: int = 0  # leading tokens resumed from the private pool (prefix cache)
    segments_built_remotely: int = 0  # of the missed, those a peer worker built
    remote_prefill_tokens: int = 0  # the tokens of those documents
    combined_early_tokens: int = 0  # the head of the prompt combined while its documents were still arriving

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
        self.prefix_hit_tokens = head.prefix_hit_tokens
        self.combined_early_tokens = head.prompt_tokens
        self.segments_hit += head.segments_hit
        self.segments_missed += head.segments_missed
        self.combine_tokens += head.combine_tokens


@dataclass(frozen=True)
class BuiltForRequest:
    """Work done for one request before its combine pass: the public-pool keys of the documents
    built for it (anywhere), how many of them and how many tokens peers built, and the heads of its
    prompt combined early (their stats, shortest first)."""

    keys: frozenset[str] = frozenset()
    remote_segments: int = 0
    remote_tokens: int = 0
    heads: tuple[PrefillStats, ...] = ()

    def with_head(self, head: PrefillStats | None) -> "BuiltForRequest":
        """This record with one more head combined early (None: nothing was combined)."""
        if head is None:
            return self
        return BuiltForRequest(self.keys, self.remote_segments, self.remote_tokens, (*self.heads, head))

    def head_ending_at(self, tokens: int) -> PrefillStats | None:
        """The early-combined head of ``tokens`` tokens, if any (a resume there was made for this request)."""
        return next((head for head in reversed(self.heads) if head.prompt_tokens == tokens), None)
