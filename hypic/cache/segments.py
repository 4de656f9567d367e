"""Request anatomy: split a prompt on the separator, tokenize each part, lay out recompute runs.

``text = L SEP C1 SEP ... SEP Cn SEP Q``: L sits at position 0 and is cached in full; each C is a
PIC segment whose interior (all but its seams: max(w, k-1) tokens at the head, w at the tail) can
be spliced from cache; Q and every seam are recomputed.
"""
import re
from collections import defaultdict
from dataclasses import dataclass, field
from enum import IntFlag
from functools import cached_property, lru_cache
from typing import Callable

from ..errors import InvalidRequest, as_written

DEFAULT_SEPARATOR = "<<PIC_SEP>>"


@dataclass(frozen=True)
class PromptParts:
    """Token ids of each part of a request; ``segments`` are the PIC segments C1..Cn; ``namespace``:
    the cache namespace it reuses from and caches into ("": the shared one; a request's
    ``cache_salt`` / ``extra_key`` or API key names another). ``warnings``: what the client should
    know about how its text was read (near misses of the separator), found once, when it was split."""

    leading: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    trailing: tuple[int, ...]
    namespace: str = ""
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @cached_property
    def token_ids(self) -> list[int]:
        """The request's ids: the concatenation of its parts (what full recompute also sees); made once,
        shared by every reader (never change it)."""
        ids = list(self.leading)
        for segment in self.segments:
            ids.extend(segment)
        return ids + list(self.trailing)

    @property
    def segment_starts(self) -> list[int]:
        """Global start position of each PIC segment."""
        starts, position = [], len(self.leading)
        for segment in self.segments:
            starts.append(position)
            position += len(segment)
        return starts


def split_prompt(text: str, encode: Callable[[str], list[int]], separator: str = DEFAULT_SEPARATOR) -> PromptParts:
    """Split on ``separator`` and tokenize each part on its own. No separator: the whole text is Q.
    Raises ``InvalidRequest`` for a prompt with no tokens or an empty segment between separators."""
    if not isinstance(text, str):
        raise InvalidRequest(f"prompt must be a string, got {type(text).__name__}")
    if not separator:
        raise InvalidRequest("the PIC separator must be a non-empty string")
    encoded = [tuple(encode(piece)) for piece in text.split(separator)]
    if not any(encoded):
        raise InvalidRequest("the prompt has no tokens (empty, or separators only)")
    warnings = separator_near_misses(text, separator)
    if len(encoded) == 1:
        return PromptParts((), (), encoded[0], warnings=warnings)
    for index, segment in enumerate(encoded[1:-1]):
        if not segment:
            raise InvalidRequest(f"segment {index + 1} is empty: two separators with nothing between them")
    return PromptParts(encoded[0], tuple(encoded[1:-1]), encoded[-1], warnings=warnings)


def separator_near_misses(text: str, separator: str) -> tuple[str, ...]:
    """A warning for each distinct near miss of ``separator`` in ``text``: its name with other
    brackets around it (``<<PIC_SEP>``, ``<PIC_SEP>>>``), another case, or ``-`` / a space for ``_``.
    Only the exact separator marks a segment, so a near miss is most likely a typo the client
    wants to hear about. A separator without a name between its brackets has no near misses."""
    pattern = _near_miss_pattern(separator)
    seen: dict[str, int] = {}
    for match in pattern.finditer(text) if pattern is not None else ():
        found = match.group()
        if found != separator and found not in seen and found != match.group(1):  # a bare name is prose
            seen[found] = match.start()
    return tuple(_near_miss_warning(found, at, separator) for found, at in seen.items())


@lru_cache(maxsize=8)
def _near_miss_pattern(separator: str) -> re.Pattern[str] | None:
    """``separator``'s name (its one group) with any run of its brackets on either side."""
    lead, name, trail = re.fullmatch(r"(\W*)(.*?)(\W*)", separator, re.DOTALL).groups()  # type: ignore[union-attr]
    if not name or not (lead or trail):
        return None
    spelled = "".join("[-_ ]" if c in "-_ " else re.escape(c) for c in name)
    return re.compile(f"{_any_run_of(lead)}({spelled}){_any_run_of(trail)}", re.IGNORECASE)


def _any_run_of(chars: str) -> str:
    return f"[{re.escape(''.join(sorted(set(chars))))}]*" if chars else ""


def _near_miss_warning(found: str, at: int, separator: str) -> str:
    if separator in found:
        return (f"the prompt holds {as_written(found)} at character {at}: the PIC separator {separator} with "
                "extra characters next to it; the separator splits the prompt there and the extra characters are "
                "served as text")
    return (f"the prompt holds {as_written(found)} at character {at}, which looks like the PIC separator {separator} "
            "but is not it: it was served as text (only the exact separator marks a segment)")


@dataclass(frozen=True)
class Run:
    """Tokens recomputed in the combine pass: positions [start, start + length)."""

    start: int
    length: int


@dataclass(frozen=True)
class Splice:
    """The cached interior of PIC segment ``segment`` placed at global positions [start, start + length)."""

    segment: int
    start: int
    length: int


Piece = Run | Splice


@dataclass(frozen=True)
class Seams:
    """How a PIC segment is cut: ``head`` and ``tail`` tokens recomputed at splice time, the
    interior between them cached."""

    head: int
    tail: int

    @classmethod
    def for_model(cls, seam_width: int, conv_kernel: int) -> "Seams":
        """HYPIC's cut: w tokens at each end, and at least k - 1 at the head, whose conv windows
        reach into the previous segment, so that layer 0 composes exactly for any w."""
        return cls(max(seam_width, conv_kernel - 1), seam_width)

    def interior(self, length: int) -> tuple[int, int] | None:
        """Segment-local [lo, hi) of the interior of a segment of ``length`` tokens, or None."""
        lo, hi = self.head, length - self.tail
        return (lo, hi) if lo < hi else None


def spliceable(parts: PromptParts, seams: Seams) -> list[int]:
    """Indices of the PIC segments whose interior is spliced: those that have one, unless it would
    hold the prompt's last token (whose logits start generation, so it is always recomputed)."""
    total = len(parts.token_ids)
    found = []
    for index, (segment, begin) in enumerate(zip(parts.segments, parts.segment_starts)):
        interior = seams.interior(len(segment))
        if interior is not None and begin + interior[1] < total:
            found.append(index)
    return found


class PartMark(IntFlag):
    """What a token is in its request's layout; the private pool keys PIC-assembled states on the
    token ids *and* these marks, so a state is resumed only under the same segmentation."""

    PART_END = 1  # last token of L or of a PIC segment
    SEGMENT_START = 2  # first token of a PIC segment recomputed in full
    SPLICED_START = 4  # first token of a PIC segment whose interior is spliced
    QUERY_START = 8  # first token of Q


MARK_BITS = 4


def layout_marks(parts: PromptParts, spliced: list[int]) -> dict[int, int]:
    """Position -> ``PartMark`` bits of a request whose segments ``spliced`` are spliced; empty when
    none is (the request is then computed exactly, like a plain prompt)."""
    if not spliced:
        return {}
    marks: defaultdict[int, int] = defaultdict(int)
    if parts.leading:
        marks[len(parts.leading) - 1] |= PartMark.PART_END
    for index, (segment, begin) in enumerate(zip(parts.segments, parts.segment_starts)):
        marks[begin] |= PartMark.SPLICED_START if index in spliced else PartMark.SEGMENT_START
        marks[begin + len(segment) - 1] |= PartMark.PART_END
    if parts.trailing:
        marks[len(parts.token_ids) - len(parts.trailing)] |= PartMark.QUERY_START
    return dict(marks)


def _append_run(pieces: list[Piece], start: int, length: int) -> None:
    """Append a run, merging it into a run that ends where it starts."""
    if length <= 0:
        return
    if pieces and isinstance(pieces[-1], Run) and pieces[-1].start + pieces[-1].length == start:
        pieces[-1] = Run(pieces[-1].start, pieces[-1].length + length)
    else:
        pieces.append(Run(start, length))


def build_layout(parts: PromptParts, seams: Seams | None, spliced: set[int], start: int = 0) -> list[Piece]:
    """Pieces for positions [start, end) in position order; ``start`` is where the state the pass
    continues from ends (L's end, or a private-pool hit). ``spliced``: indices of segments to splice
    from cache (each ``spliceable`` and beginning at or after ``start``); every other segment is
    recomputed from ``start`` on."""
    pieces: list[Piece] = []
    total = len(parts.token_ids)
    _append_run(pieces, start, len(parts.leading) - start)
    for index, (segment, begin) in enumerate(zip(parts.segments, parts.segment_starts)):
        end = begin + len(segment)
        if index in spliced:
            interior = seams.interior(len(segment)) if seams is not None else None
            if interior is None or begin < start or begin + interior[1] >= total:
                raise ValueError(f"segment {index} cannot be spliced here")
            _append_run(pieces, begin, interior[0])
            pieces.append(Splice(index, begin + interior[0], interior[1] - interior[0]))
            _append_run(pieces, begin + interior[1], end - begin - interior[1])
        elif end > start:
            _append_run(pieces, max(begin, start), end - max(begin, start))
    trailing_start = total - len(parts.trailing)
    _append_run(pieces, max(trailing_start, start), total - max(trailing_start, start))
    return pieces


def document_boundaries(parts: PromptParts) -> list[int]:
    """Positions where L and each PIC segment end (before the last token): the private pool's
    snapshot points, so a later request sharing a document prefix resumes at a document edge."""
    ends = [start + len(segment) for start, segment in zip(parts.segment_starts, parts.segments)]
    total = len(parts.token_ids)
    return sorted({p for p in [len(parts.leading), *ends] if 0 < p < total})


def chunk_pieces(pieces: list[Piece], max_tokens: int) -> list[list[Piece]]:
    """Consecutive groups of pieces with at most ``max_tokens`` recompute tokens each (runs are cut
    where needed; splices cost nothing and join the next run's group, so every group ends in a run)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    budget = max_tokens
    for piece in pieces:
        if isinstance(piece, Splice):
            current.append(piece)
            continue
        start, left = piece.start, piece.length
        while left:
            take = min(left, budget)
            current.append(Run(start, take))
            start, left, budget = start + take, left - take, budget - take
            if budget == 0:
                groups.append(current)
                current, budget = [], max_tokens
    if current:
        groups.append(current)
    return groups
