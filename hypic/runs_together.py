"""A linear layer's runs in a combine pass, every request's together, in a fixed number of ops
whatever the document count.

Each request's runs are cut into units: chunks of at most the family's chunk size
(``chained_recurrence``, on every device), or on CUDA, for a family with FLA's varlen kernel, whole
parts of runs cut at the snapshot positions (``varlen_recurrence``). Every unit and every spliced
document is an affine map of the state before it, S -> T S + B; a request's prefix state, then its
units and splices in order, make one chain, and the chains of all requests run as one program
(``hypic.kernels.affine_chain``). From the state entering each unit come its outputs: through the
units' maps (``ChunkMaps``: outputs = zero-start outputs + entry queries @ S, in one batched
product), or through a second varlen call; a snapshot inside a chunk comes from the maps of the
chunk's prefix, applied to the chunk's entering state.

What the pass's layout decides (which rows of which tensor each unit, element, window and
snapshot reads) depends only on the requests' pieces and snapshot positions, not on the layer: it
is worked out once per pass (``RunsLayout``) and its index tensors are read by every layer.
Families without chunk maps (a family a test registers) and documents being built (whose
interiors are captured) run one kernel call per run (``assembler._linear_runs``).
"""
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from .cache.composition import Family, Transition, stacked_values
from .cache.segments import Piece, Run, Splice
from .cache.store import LinearInterior, SegmentEntry
from .kernels.affine_chain import AffineMaps, ChainStep, MapViews, run_chain
from .kernels.dispatch import ChunkMaps, run_varlen
from .models.linear import LinearFamily, LinearMixer, last_rows
from .state import LinearLayerState, RequestState


class PassOfRuns(Protocol):
    """What a combine pass tells the recurrence (a ``CombineWork``)."""

    pieces: list[Piece]
    entries: dict[int, SegmentEntry]
    init: RequestState
    naive: bool


def runs_batched(device: torch.device) -> bool:
    """Whether FLA's fused kernels run a layer's units on ``device`` (CUDA): a dense varlen family's
    as whole parts in varlen calls (``varlen_recurrence``), the others' one call per run when a pass
    splices nothing (a cold prompt: a few long runs, where the fused kernel beats the chunked form)."""
    return device.type == "cuda"


Recurrence = Callable[..., tuple[torch.Tensor, list[LinearLayerState]]]


@dataclass(frozen=True)
class Strategy:
    """How a pass runs its works' units in a linear layer: ``run`` (``chained_recurrence`` or
    ``varlen_recurrence``), units cut into chunks of the family's size (``chunked``) or whole parts."""

    run: Recurrence
    chunked: bool


def recurrence_for(family: LinearFamily, device: torch.device, spliced: bool) -> Strategy | None:
    """The strategy of a pass in a layer of ``family`` on ``device`` (``spliced``: whether any of its
    works splices a document); None: one kernel call per run (``assembler._linear_runs``)."""
    fused = runs_batched(device)
    if fused and family.apart_because is None:
        return Strategy(varlen_recurrence, False)
    if family.kernels.chunk_maps is None or (fused and not spliced and family.kernels.fla is not None):
        return None
    return Strategy(chained_recurrence, True)


@dataclass(frozen=True)
class SnapshotAt:
    """A state to record: ``position`` of work ``work``; the state a chain step wrote (``row``: a
    (buffer, row)), or a unit prefix's (``prefix``: its index in ``RunsLayout.prefixes``), or else
    the work's final state from the varlen call; the conv window from conv-source rows ``conv``."""

    work: int
    position: int
    conv: tuple[int, ...]
    row: tuple[str, int] | None = None
    prefix: int | None = None


@dataclass
class RunsLayout:
    """Where everything of a pass's linear layers comes from and goes, for the works run together,
    one conv width (k - 1) and a chunk size: a run is cut into units of at most ``chunk`` tokens, a
    snapshot inside a unit being the state after a prefix of it (``prefixes``); or (None: the
    varlen strategy) a run is cut at its snapshot positions into parts, each a unit. Rows of the
    conv source: the works' tokens, then each work's entering conv window, then each splice's conv
    tail. The chain (``steps``) writes each element's state into the ``entering`` buffer's row of
    the unit that follows it, or else a row of ``other``."""

    works: int
    tokens: int
    width: int
    chunk: int | None
    conv_rows: list[int] = field(default_factory=list)  # windows laid end to end
    post_rows: list[int] = field(default_factory=list)  # per token: its conv output's row
    units: list[tuple[int, int]] = field(default_factory=list)  # (first token row, tokens)
    prefixes: list[tuple[int, int]] = field(default_factory=list)  # (unit, tokens): a snapshot inside a unit
    chained: list[int] = field(default_factory=list)  # units with a map in the chain, in its order
    steps: list[ChainStep] = field(default_factory=list)
    others: int = 0  # rows of the ``other`` buffer
    finals: list[tuple[str, int] | None] = field(default_factory=list)  # per work: its last state's row
    last_units: list[int] = field(default_factory=list)  # per work: its last unit
    final_conv: list[tuple[int, ...]] = field(default_factory=list)
    snapshots: list[SnapshotAt] = field(default_factory=list)
    splices: list[tuple[int, Splice]] = field(default_factory=list)  # (work, piece) in order
    naive: list[bool] = field(default_factory=list)  # per splice: composed by addition
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, works: list[PassOfRuns], snapshot_at: list[list[int]], width: int, chunk: int | None) -> "RunsLayout":
        tokens = sum(p.length for work in works for p in work.pieces if isinstance(p, Run))
        layout = cls(len(works), tokens, width, chunk)
        row = 0
        for number, (work, positions) in enumerate(zip(works, snapshot_at)):
            row = layout._add_work(number, work, sorted(positions), row)
        return layout

    def _add_work(self, number: int, work: PassOfRuns, positions: list[int], row: int) -> int:
        """Lay out one work's pieces from token row ``row``; returns the row after its tokens."""
        elements: list[tuple[str, int]] = [("start", number)]  # (family, index) in chain order
        ends: list[tuple[int, int, tuple[int, ...]]] = []  # (position, element, conv rows) to record
        history = self._conv_block(number, "init")
        for piece in work.pieces:
            if isinstance(piece, Splice):
                elements.append(("add" if work.naive else "splice", len(self.splices)))
                self.splices.append((number, piece))
                self.naive.append(work.naive)
                history = self._conv_block(len(self.splices) - 1, "splice")
            else:
                history = self._add_run(number, piece, row, history, positions, elements, ends)
                row += piece.length
            if piece.start + piece.length in positions:
                ends.append((piece.start + piece.length, len(elements) - 1, history))
        self.last_units.append(len(self.units) - 1)
        self.final_conv.append(history)
        if self.chunk is None:  # the varlen call gives the last unit's state: no map of it is needed
            elements.pop()
            self.chained.pop()
        self._chain(number, elements, ends)
        return row

    def _conv_block(self, index: int, kind: str) -> tuple[int, ...]:
        """Conv-source rows of work ``index``'s entering window or splice ``index``'s tail."""
        first = self.tokens + (index if kind == "init" else self.works + index) * self.width
        return tuple(range(first, first + self.width))

    def _add_run(self, number: int, run: Run, row: int, history: tuple[int, ...], positions: list[int],
                 elements: list[tuple[str, int]], ends: list) -> tuple[int, ...]:
        """A run's window and units; returns the conv window after the run."""
        window = (*history, *range(row, row + run.length))
        self.post_rows += range(len(self.conv_rows), len(self.conv_rows) + run.length)
        self.conv_rows += window
        inside = [p - run.start for p in positions if run.start < p < run.start + run.length]
        cuts = [0, run.length] if self.chunk else [0, *inside, run.length]
        for lo, hi in itertools.pairwise(cuts):
            for first in range(lo, hi, self.chunk or hi - lo):
                elements.append(("unit", len(self.chained)))
                self.chained.append(len(self.units))
                self.units.append((row + first, min(self.chunk or hi - lo, hi - first)))
                self._snapshots_in_unit(number, run.start, first, inside, window, len(elements) - 1, ends)
        return window[len(window) - self.width :] if self.width else ()

    def _snapshots_in_unit(self, number: int, start: int, first: int, inside: list[int], window: tuple[int, ...],
                           element: int, ends: list) -> None:
        """The snapshots in the unit just added (its first token at run offset ``first``): at its end,
        the state after it; short of its end, the state after a prefix of it."""
        unit, length = len(self.units) - 1, self.units[-1][1]
        for offset in (c for c in inside if first < c <= first + length):
            conv = window[offset : offset + self.width]
            if offset == first + length:
                ends.append((start + offset, element, conv))
            else:
                self.snapshots.append(SnapshotAt(number, start + offset, conv, prefix=len(self.prefixes)))
                self.prefixes.append((unit, offset - first))

    def _chain(self, number: int, elements: list[tuple[str, int]], ends: list) -> None:
        """The work's chain steps: each element's state into the ``entering`` row of the unit after it,
        or a row of ``other``; its snapshots at element ends and its final state read those rows."""
        targets: list[tuple[str, int]] = []
        for i, (family, index) in enumerate(elements):
            following = elements[i + 1] if i + 1 < len(elements) else None
            if following is not None and following[0] == "unit":
                targets.append(("entering", self.chained[following[1]]))
            elif following is None and self.chunk is None:  # the varlen call's last unit follows
                targets.append(("entering", self.last_units[-1]))
            else:
                targets.append(("other", self.others))
                self.others += 1
            self.steps.append(ChainStep(family, index, targets[i - 1] if i else None, targets[i]))
        for position, element, conv in ends:
            removed = element >= len(elements)  # the varlen call's last unit
            self.snapshots.append(SnapshotAt(number, position, conv, None if removed else targets[element]))
        self.finals.append(None if self.chunk is None else targets[-1])

    def buffers(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The chain's state buffers for states like ``like`` [H, K, V]: ``entering`` made once per pass
        and reused by every layer (what a layer keeps of it, it copies out), so no layer pays for
        fresh pages; ``other`` made anew, its rows handed on as they are (snapshots at splice ends)."""
        key = f"entering:{tuple(like.shape)}:{like.dtype}:{like.device}"
        if key not in self._buffers:
            self._buffers[key] = like.new_empty(len(self.units), *like.shape)
        return {"entering": self._buffers[key], "other": like.new_empty(self.others, *like.shape)}

    # ----- the index tensors ------------------------------------------------------------------
    def tensor(self, name: str, device: torch.device) -> torch.Tensor:
        """The layout's index tensor ``name`` on ``device``, made once per pass (every layer reads it)."""
        if name not in self._tensors:
            self._tensors[name] = torch.tensor(self._values(name), dtype=torch.long).to(device)
        return self._tensors[name]

    def _values(self, name: str) -> list:
        values = {
            "conv_rows": lambda: self.conv_rows, "post_rows": lambda: self.post_rows,
            "last_units": lambda: self.last_units, "prefix_units": lambda: [u for u, _ in self.prefixes],
            "prefix_lengths": lambda: [n for _, n in self.prefixes],
            "final_rows": lambda: [row for _, row in self.finals],  # type: ignore[misc]
            "final_conv": lambda: [list(rows) for rows in self.final_conv],
            "snapshot_conv": lambda: [list(s.conv) for s in self.snapshots],
            "unit_rows": self._unit_rows, "token_slots": self._token_slots,
        }
        if name.startswith("snapshot_rows:"):  # the rows of one buffer that snapshots read
            buffer = name.partition(":")[2]
            return [s.row[1] for s in self.snapshots if s.row is not None and s.row[0] == buffer]
        return values[name]()

    def _unit_rows(self) -> list[list[int]]:
        """Each unit's token rows padded to the chunk size with the zero row (``tokens``)."""
        assert self.chunk is not None
        return [[*range(first, first + n), *[self.tokens] * (self.chunk - n)] for first, n in self.units]

    def _token_slots(self) -> list[int]:
        """Each token's slot in the [units x chunk] grid, in token order."""
        assert self.chunk is not None
        return [u * self.chunk + i for u, (_, n) in enumerate(self.units) for i in range(n)]

    @property
    def lengths(self) -> list[int]:
        return [n for _, n in self.units]


# ----- the conv ----------------------------------------------------------------------------------------
def conv_windows(mixer: LinearMixer, pre_conv: torch.Tensor, pieces: list[Piece], entries: dict[int, SegmentEntry],
                 index: int, conv: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each run's conv window (the k-1 inputs before it: the previous run's, or a spliced interior's
    cached tail; then its own), as views of one tensor, and the post-conv rows of all runs [N, C].
    One convolution covers every window laid end to end; the rows straddling two windows are dropped."""
    parts, lengths, offset, width = [], [], 0, mixer.kernel - 1
    for piece in pieces:
        if isinstance(piece, Splice):
            conv = _interior(entries, piece, index).conv_tail
        else:
            own = pre_conv[offset : offset + piece.length]
            parts += [conv.to(pre_conv.dtype), own]
            lengths.append(piece.length)
            conv = last_rows(own if piece.length >= width else torch.cat([conv.to(pre_conv.dtype), own]), width)
            offset += piece.length
    stacked = torch.cat(parts)
    starts = [sum(lengths[:i]) + i * width for i in range(len(lengths))]  # each window's first row
    windows = [stacked[lo : lo + n + width] for lo, n in zip(starts, lengths)]
    post_conv = mixer.convolve(stacked)  # row j: the token at window row j + width
    if len(lengths) == 1:
        return windows, post_conv
    rows = torch.cat([torch.arange(lo, lo + n) for lo, n in zip(starts, lengths)])
    return windows, post_conv[rows.to(post_conv.device)]


def _interior(entries: dict[int, SegmentEntry], piece: Splice, index: int) -> LinearInterior:
    cached = entries[piece.segment].layers[index]
    assert isinstance(cached, LinearInterior)
    return cached


def conv_source(pre_conv: torch.Tensor, works: list[PassOfRuns], layout: RunsLayout, index: int) -> torch.Tensor:
    """The rows every conv window reads: the tokens' conv inputs [N, C], each work's entering window,
    each splice's cached tail (one concatenation, in pre_conv's dtype)."""
    if not layout.width:
        return pre_conv
    windows = [work.init.layers[index].conv for work in works]
    tails = [_interior(works[w].entries, piece, index).conv_tail for w, piece in layout.splices]
    return torch.cat([pre_conv, *windows, *tails]).to(pre_conv.dtype)


def convolved(mixer: LinearMixer, source: torch.Tensor, layout: RunsLayout) -> torch.Tensor:
    """Every token's post-conv row [N, C]: one convolution over all windows end to end, the rows
    straddling two windows dropped."""
    if not layout.width:
        return mixer.convolve(source)
    stacked = source.index_select(0, layout.tensor("conv_rows", source.device))
    return mixer.convolve(stacked).index_select(0, layout.tensor("post_rows", source.device))


# ----- the chain -------------------------------------------------------------------------------------
def splice_maps(mixer: LinearMixer, works: list[PassOfRuns], layout: RunsLayout, index: int) -> MapViews | None:
    """Every splice's map in order: S_C|0 (turned to its start for a layer with RoPE inside its
    state) and T_C, fp32 (a naive splice adds S_C|0 alone). What the pool holds as fp32 (dense T_C
    with every head kept, S_C|0 at its cached start) is read where it lies; the rest is stacked and
    converted (one op each, whatever the count)."""
    if not layout.splices:
        return None
    interiors = [_interior(works[w].entries, piece, index) for w, piece in layout.splices]
    held = [c.transition for c, naive in zip(interiors, layout.naive) if not naive]
    if any(t is None for t in held):
        raise ValueError("a splice composed by eq. 6 has no T_C: its entry was cached for naive addition")
    offsets = _splice_offsets(mixer, works, layout, interiors)
    if not held:
        return MapViews(offsets)
    if held[0].family is Family.DENSE:  # type: ignore[union-attr]
        return MapViews(offsets, dense=_dense_transitions([c.transition for c in interiors]))
    values = stacked_values([held[0].with_value(torch.zeros_like(held[0].value)) if c.transition is None  # type: ignore[union-attr]
                             else c.transition for c in interiors])
    return MapViews(offsets, scale=values.reshape(*values.shape, *([1] * (4 - values.dim()))).unbind(0))


def _dense_transitions(transitions: list[Transition | None]) -> list[torch.Tensor | None]:
    """Each splice's dense T_C [H, K, K] in fp32: the pool's tensor itself where it is that (every
    head kept, stored in fp32); the others (decayed heads flagged, stored narrower) stacked in full
    together (a few ops for any count). None for a naive splice."""
    direct = [t is None or (t.kept is None and t.value.dtype == torch.float32) for t in transitions]
    expanded = iter(stacked_values([t for t, plain in zip(transitions, direct) if not plain]).unbind(0)) \
        if not all(direct) else iter(())  # type: ignore[misc]
    return [(None if t is None else t.value) if plain else next(expanded) for t, plain in zip(transitions, direct)]


def _splice_offsets(mixer: LinearMixer, works: list[PassOfRuns], layout: RunsLayout,
                    interiors: list[LinearInterior]) -> Sequence[torch.Tensor]:
    """Each splice's S_C|0 in fp32 at its start: the pool's tensors where they are that already."""
    if not mixer.rotates_state and all(c.zero_start_state.dtype == torch.float32 for c in interiors):
        return [c.zero_start_state for c in interiors]
    offsets = torch.stack([cached.zero_start_state for cached in interiors]).float()
    if mixer.rotates_state:
        deltas = [piece.start - works[w].entries[piece.segment].local_start for w, piece in layout.splices]
        offsets = mixer.rotate_states(offsets, deltas)
    return offsets.unbind(0)


def chain_states(mixer: LinearMixer, works: list[PassOfRuns], layout: RunsLayout, index: int,
                 units: AffineMaps) -> dict[str, torch.Tensor]:
    """Run the pass's chains (``layout.steps``) from the works' entering states through the chained
    units' ``units`` maps and the splices: the state entering each unit (``entering`` [U, H, K, V])
    and the other states the steps wrote (``other``), fp32."""
    starts = torch.stack([work.init.layers[index].recurrent for work in works]).float()
    buffers = layout.buffers(starts[0])
    run_chain(layout.steps, starts, units, splice_maps(mixer, works, layout, index), buffers)
    return buffers


def _record(layout: RunsLayout, buffers: dict[str, torch.Tensor], finals: torch.Tensor, source: torch.Tensor,
            prefixes: AffineMaps | None, snapshots: list[dict[int, dict]], index: int) -> list[LinearLayerState]:
    """Each work's final state (``finals`` [W, H, K, V]) with its conv window, and the snapshots asked
    for (into ``snapshots[work][position][index]``): states the chain wrote, states after unit
    prefixes (``prefixes`` applied to their units' entering states), or final states."""
    device = source.device
    windows = _rows(source, layout, "final_conv", layout.works)
    made = [LinearLayerState(state, conv) for state, conv in zip(finals.unbind(0), windows.unbind(0))]
    if not layout.snapshots:
        return made
    read = {"entering": iter(buffers["entering"].index_select(0, layout.tensor("snapshot_rows:entering", device))
                             .unbind(0))}
    rows_of_other = buffers["other"].unbind(0)  # this layer's own: its rows are handed on as they are
    if prefixes is not None:
        read["prefix"] = iter(prefixes.apply(buffers["entering"].index_select(0, layout.tensor("prefix_units", device)))
                              .unbind(0))
    convs = _rows(source, layout, "snapshot_conv", len(layout.snapshots)).unbind(0)
    for at, conv in zip(layout.snapshots, convs):
        if at.row is not None:
            state = next(read["entering"]) if at.row[0] == "entering" else rows_of_other[at.row[1]]
        else:
            state = next(read["prefix"]) if at.prefix is not None else made[at.work].recurrent
        snapshots[at.work][at.position][index] = LinearLayerState(state, conv)
    return made


def _rows(source: torch.Tensor, layout: RunsLayout, name: str, count: int) -> torch.Tensor:
    """Conv windows [count, k - 1, C] gathered from the conv source by the layout's rows ``name``."""
    if not layout.width:
        return source.new_zeros(count, 0, source.shape[1])
    rows = layout.tensor(name, source.device)
    return source.index_select(0, rows.flatten()).view(*rows.shape, source.shape[1])


# ----- the units' recurrences ----------------------------------------------------------------------------
def chunk_grid(x: torch.Tensor, layout: RunsLayout) -> torch.Tensor:
    """Token rows x [N, H, ...] as the units' chunks [U, H, C, ...], zero-padded."""
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, 1))
    rows = layout.tensor("unit_rows", x.device)
    return padded.index_select(0, rows.flatten()).view(*rows.shape, *x.shape[1:]).transpose(1, 2)


def chained_recurrence(mixer: LinearMixer, proj: Any, works: list[PassOfRuns], index: int,
                       snapshots: list[dict[int, dict]], layout: RunsLayout) -> tuple[torch.Tensor, list[LinearLayerState]]:
    """Every run of every work in layer ``index`` through its chunks' maps (``proj``: the works'
    token projections, in order). Returns the outputs [N, H, V] and each work's final state."""
    source = conv_source(proj.pre_conv, works, layout, index)
    inputs = mixer.recurrence_inputs(convolved(mixer, source, layout), proj)
    family, args = mixer.family, mixer.family.kernel_args(inputs)
    kernels, scale = family.kernels, family.kernels.scale(args[1].shape[-1])
    prefixes = (layout.tensor("prefix_units", source.device), layout.tensor("prefix_lengths", source.device)) \
        if layout.prefixes else None
    maps: ChunkMaps = kernels.chunk_maps(*(chunk_grid(x, layout) for x in args), scale=scale, prefixes=prefixes)
    buffers = chain_states(mixer, works, layout, index, maps.maps)
    chunks = torch.matmul(maps.entry_queries, buffers["entering"]).add_(maps.zero_outputs)
    outputs = chunks.transpose(1, 2).flatten(0, 1).index_select(0, layout.tensor("token_slots", chunks.device))
    finals = buffers["other"].index_select(0, layout.tensor("final_rows", chunks.device))
    return family.with_skip(outputs, inputs), _record(layout, buffers, finals, source, maps.prefix_maps, snapshots, index)


def concat_inputs(inputs: list[Any]) -> Any:
    """Recurrence inputs laid end to end."""
    if len(inputs) == 1:
        return inputs[0]
    names = [f.name for f in dataclasses.fields(inputs[0])]
    return type(inputs[0])(**{name: torch.cat([getattr(x, name) for x in inputs]) for name in names})


def family_varlen(family: LinearFamily, inputs: Any, lengths: list[int],
                  initial_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``family``'s kernels over runs laid end to end, run r from ``initial_states[r]``."""
    if family.apart_because is not None:
        raise ValueError(f"cannot run a layer's runs together: {family.apart_because}")
    return run_varlen(family.kernels, family.kernel_args(inputs), lengths, initial_states)


def run_maps(family: LinearFamily, inputs: Any, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's affine map S -> T_r S + S_r|0: S_r|0 [R, H, K, V] and T_r [R, H, K, K]. One varlen
    call runs every run twice (from zero with its values; from I with zero values) when K = V."""
    runs, heads, dim = len(lengths), inputs.k.shape[1], inputs.k.shape[2]
    zeros = inputs.v.new_zeros(runs, heads, dim, inputs.v.shape[2])
    eye = torch.eye(dim, device=inputs.k.device).expand(runs, heads, dim, dim)
    unwritten = dataclasses.replace(inputs, v=torch.zeros_like(inputs.k))  # from I: the state is T_r
    if inputs.v.shape[2] == dim:
        _, finals = family_varlen(family, concat_inputs([inputs, unwritten]), lengths * 2, torch.cat([zeros, eye]))
        return finals[:runs], finals[runs:]
    _, zero_states = family_varlen(family, inputs, lengths, zeros)
    _, transitions = family_varlen(family, unwritten, lengths, eye)
    return zero_states, transitions


def _chained_inputs(inputs: Any, layout: RunsLayout) -> tuple[Any, list[int]]:
    """The recurrence inputs and lengths of the chained units (each work's units but its last: a
    prefix of the work's tokens)."""
    lengths = [layout.units[u][1] for u in layout.chained]
    spans, first = [], 0
    for last in layout.last_units:
        end = layout.units[last][0]
        spans.append(inputs.slice(layout.units[first][0], end))
        first = last + 1
    return concat_inputs(spans), lengths


def varlen_recurrence(mixer: LinearMixer, proj: Any, works: list[PassOfRuns], index: int,
                      snapshots: list[dict[int, dict]], layout: RunsLayout) -> tuple[torch.Tensor, list[LinearLayerState]]:
    """``chained_recurrence`` with whole parts as units in two varlen calls: the chained parts' maps,
    then every part from its entering state (the outputs, and each work's final state)."""
    source = conv_source(proj.pre_conv, works, layout, index)
    inputs = mixer.recurrence_inputs(convolved(mixer, source, layout), proj)
    heads, key, value = inputs.k.shape[1], inputs.k.shape[2], inputs.v.shape[2]
    if layout.chained:
        chained, lengths = _chained_inputs(inputs, layout)
        zero_states, transitions = run_maps(mixer.family, chained, lengths)
    else:
        zero_states, transitions = inputs.v.new_zeros(0, heads, key, value), inputs.v.new_zeros(0, heads, key, key)
    buffers = chain_states(mixer, works, layout, index, AffineMaps(zero_states.float(), dense=transitions.float()))
    outputs, finals = family_varlen(mixer.family, inputs, layout.lengths, buffers["entering"])
    last = finals.index_select(0, layout.tensor("last_units", finals.device))
    return mixer.family.with_skip(outputs, inputs), _record(layout, buffers, last, source, None, snapshots, index)
