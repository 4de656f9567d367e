"""The combine pass: run only the recompute tokens through every layer, splicing
cached segment interiors in between.

One code path serves full prefill (a single run from position 0), segment prefill (a single run
with an ``InteriorCapture``) and the HYPIC combine pass (runs and splices), for one request or for
several at once (``combine_batch``: token-wise work over all their tokens together, the recurrence
and attention per request, inside each layer).
"""
import copy
import itertools
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .cache.composition import Transition, compose_states, naive_addition
from .models import HybridModel
from .models.attention import AttentionGroup, AttentionInputs, GatedAttention, attention_groups
from .models.linear import LinearMixer, RunRecurrence, last_rows
from .models.rope import RotaryEmbedding
from .kernels.dispatch import denormals_flushed
from .runs_together import RunsLayout, conv_windows, recurrence_for
from .cache.segments import Piece, Run, Splice, chunk_pieces
from .state import AttentionLayerState, LinearLayerState, RequestState, WindowLayerState
from .cache.store import AttentionInterior, InteriorLayer, LinearInterior, SegmentEntry


@dataclass
class InteriorCapture:
    """Collects a segment's interior [lo, hi) per layer while the segment is prefilled alone;
    ``transitions``: whether linear layers also get T_C (the naive baseline stores S_C|0 only)."""

    lo: int
    hi: int
    transitions: bool = True
    layers: dict[int, InteriorLayer] = field(default_factory=dict)
    entry_states: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its state at ``lo``
    running: dict[int, Transition] = field(default_factory=dict)  # layer -> T of the interior so far

    def recur(self, mixer: LinearMixer, index: int, start: int, inputs: Any, state: torch.Tensor,
              window: torch.Tensor) -> RunRecurrence:
        """The recurrence of one run (positions from ``start``) that also folds its interior tokens
        into (T_I, S_I|0), continuing what earlier runs of a chunked prefill folded. The run reaching
        ``hi`` also yields the conv tail (window row j holds the conv input of token start - (k-1) + j)."""
        end = start + inputs.q.shape[0]
        lo, hi = max(self.lo, start), min(self.hi, end)
        if lo >= hi:
            return mixer.recur(inputs, state)
        head = mixer.recur(inputs.slice(0, lo - start), state)
        self.entry_states.setdefault(index, head.state)
        output, state = self._interior(mixer, index, inputs.slice(lo - start, hi - start), head.state, hi == self.hi)
        tail = mixer.recur(inputs.slice(hi - start, end - start), state)
        if start < self.hi <= end:
            layer = self.layers[index]
            assert isinstance(layer, LinearInterior)
            layer.conv_tail = window[self.hi - start : self.hi - start + mixer.kernel - 1].clone()
        return RunRecurrence(torch.cat([head.output, output, tail.output]), tail.state, [])

    def _interior(self, mixer: LinearMixer, index: int, part: Any, state: torch.Tensor,
                  last: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The run over interior tokens that also returns its transition; chained onto the
        transition of earlier chunks, T_I. At the interior's end S_I|0 = S_hi - T_I S_lo (the naive
        baseline keeps S_I|0 only)."""
        output, state, transition = mixer.recur_with_transition(part, state)
        earlier = self.running.get(index)
        total = self.running[index] = transition if earlier is None else earlier.then(transition)
        zero = state - total.apply(self.entry_states[index]) if last else torch.empty(0)
        kept = total if self.transitions else None
        self.layers[index] = LinearInterior(kept, zero, state.new_zeros(0))
        return output, state

    def checkpoint(self) -> Callable[[], None]:
        """A way back to what has been collected so far (a batch this capture ran in failed part way)."""
        held = dict(self.layers), dict(self.entry_states), dict(self.running)

        def restore() -> None:
            self.layers, self.entry_states, self.running = (dict(d) for d in held)
        return restore

    def window(self, index: int, keys: torch.Tensor, values: torch.Tensor, key_positions: list[int],
               window: int) -> None:
        """A sliding-window layer keeps only its interior's last ``window`` tokens' K and V: no later
        token sees further back (``key_positions``: the positions of keys / values [Hkv, T, D], host integers)."""
        if index in self.layers or self.hi - 1 not in key_positions:
            return
        wanted = torch.tensor([i for i, p in enumerate(key_positions) if max(self.lo, self.hi - window) <= p < self.hi])
        wanted = wanted.to(keys.device)
        self.layers[index] = AttentionInterior(keys.index_select(1, wanted), values.index_select(1, wanted))

    def attention(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the interior's K and V once the keys (all positions so far) reach ``hi``."""
        if keys.shape[1] >= self.hi and index not in self.layers:
            self.layers[index] = AttentionInterior(keys[:, self.lo : self.hi].clone(), values[:, self.lo : self.hi].clone())


@dataclass
class CombineResult:
    """Logits of the last recompute token ([vocab] fp32, or None), the request's new state, the
    linear layers' states at each requested snapshot position (position -> layer index -> state),
    and, when asked for with ``logits_from``, the logits of every position from there on."""

    logits: torch.Tensor | None
    state: RequestState
    snapshots: dict[int, dict[int, LinearLayerState]] = field(default_factory=dict)
    row_logits: torch.Tensor | None = None  # [end - logits_from, vocab] fp32


def token_rows(proj: Any, lo: int, hi: int) -> Any:
    """A mixer's projections (a dataclass of [N, ...] tensors) for tokens lo..hi-1 only (views)."""
    part = copy.copy(proj)
    for name, value in vars(proj).items():
        if isinstance(value, torch.Tensor):
            setattr(part, name, value[lo:hi])
    return part


def _selected_rows(proj: Any, rows: torch.Tensor) -> Any:
    """A mixer's projections for the token ``rows`` [n] only (copies)."""
    part = copy.copy(proj)
    for name, value in vars(proj).items():
        if isinstance(value, torch.Tensor):
            setattr(part, name, value[rows])
    return part


@dataclass
class KVPlan:
    """Where one work's pass puts its keys and values in its full-attention states, worked out once
    for every layer: the own-buffer slots of its run tokens and of its spliced tokens, each spliced
    token's re-rotation delta, the position it ends at, and how its runs attend together."""

    run_slots: torch.Tensor
    splice_slots: torch.Tensor | None
    deltas: torch.Tensor | None
    end: int
    runs: list[tuple[int, int]]
    groups: list[AttentionGroup] | None


@dataclass
class PassContext:
    """What a batch's pass works out once (host bookkeeping and the index tensors made from it) and
    every layer reads: which works' linear units go together and their layout, each work's KV plan."""

    works: list["CombineWork"]
    rows: list[tuple[int, int]]
    snapshots: list[dict[int, dict]]
    positions: list[list[int]]  # each work's run tokens' positions (host integers)
    device: torch.device
    _linear: dict[tuple, tuple] = field(default_factory=dict)
    _kv: dict[tuple, KVPlan] = field(default_factory=dict)

    def linear(self, mixer: LinearMixer) -> tuple[list[int], RunsLayout | None, Callable | None, torch.Tensor | None]:
        """(the works run together, their layout, the recurrence that runs them, their token rows or
        None for all) for layers of ``mixer``'s family and conv width."""
        key = (mixer.family.name, mixer.kernel)
        if key not in self._linear:
            self._linear[key] = self._plan_linear(mixer)
        return self._linear[key]

    def _plan_linear(self, mixer: LinearMixer) -> tuple:
        together = [i for i, work in enumerate(self.works) if work.capture is None]
        spliced = any(isinstance(p, Splice) for i in together for p in self.works[i].pieces)
        strategy = recurrence_for(mixer.family, self.device, spliced) if together else None
        if strategy is None:
            return [], None, None, None
        chunk = _chunk_size(mixer, [p.length for i in together for p in self.works[i].pieces if isinstance(p, Run)],
                            self.device) if strategy.chunked else None
        layout = RunsLayout.of([self.works[i] for i in together], [list(self.snapshots[i]) for i in together],
                               mixer.kernel - 1, chunk)
        rows = None if len(together) == len(self.works) else torch.tensor(
            [r for i in together for r in range(*self.rows[i])], device=self.device)
        return together, layout, strategy.run, rows

    def kv(self, number: int, index: int, dtype: torch.dtype) -> KVPlan:
        """Work ``number``'s KV plan for full-attention layer ``index`` (shared by every layer whose
        splices hold as many keys: a plan per interior width)."""
        work = self.works[number]
        init = work.init.layers[index]
        assert isinstance(init, AttentionLayerState)
        widths = tuple(_attention_interior(work.entries, p, index).keys.shape[1] for p in work.pieces
                       if isinstance(p, Splice))
        key = (number, widths, init.shared_length, dtype)
        if key not in self._kv:
            self._kv[key] = _kv_plan(work, init.shared_length, dtype, self.device)
        return self._kv[key]


def _chunk_size(mixer: LinearMixer, runs: list[int], device: torch.device) -> int:
    """Tokens per chunk of a pass's runs: the family's size for its longest run, or the power of two
    covering the median run where that is less (seam runs of 16 tokens padded to 32 would double
    their chunks' work; the longer runs are cut into more chunks instead)."""
    median = sorted(runs)[len(runs) // 2]
    return min(mixer.family.kernels.chunk_size(max(runs), device), 1 << (median - 1).bit_length())


def _kv_plan(work: "CombineWork", shared: int, dtype: torch.dtype, device: torch.device) -> KVPlan:
    runs = [(p.start, p.length) for p in work.pieces if isinstance(p, Run)]
    run_slots = [q - shared for start, n in runs for q in range(start, start + n)]
    splices = [p for p in work.pieces if isinstance(p, Splice)]
    splice_slots = [q - shared for p in splices for q in range(p.start, p.start + p.length)]
    deltas = [p.start - work.entries[p.segment].local_start for p in splices for _ in range(p.length)]
    end = work.pieces[-1].start + work.pieces[-1].length

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(device)

    groups = attention_groups(runs, dtype, device) if len(runs) > 1 else None
    return KVPlan(index(run_slots), index(splice_slots) if splices else None, index(deltas) if splices else None, end,
                  runs, groups)


def _attention_interior(entries: dict[int, SegmentEntry], piece: Splice, index: int) -> AttentionInterior:
    layer = entries[piece.segment].layers[index]
    assert isinstance(layer, AttentionInterior)
    return layer


def _linear_layer(mixer: LinearMixer, h: torch.Tensor, positions: torch.Tensor, context: PassContext,
                  index: int) -> tuple[torch.Tensor, list[LinearLayerState]]:
    """Token-wise projections and output of every work's tokens at once; the conv and the recurrence
    of the works that go together in one ``runs_together`` recurrence (``PassContext.linear``), of
    the others (documents being built, a family without chunk maps) per work (``_linear_runs``)."""
    works, rows, snapshots = context.works, context.rows, context.snapshots
    proj = mixer.project(h, positions)
    together, layout, recurrence, token_index = context.linear(mixer)
    outputs: list[Any] = [None] * len(works)
    states: list[Any] = [None] * len(works)
    if together:
        part = proj if token_index is None else _selected_rows(proj, token_index)
        output, made = recurrence(mixer, part, [works[i] for i in together], index, [snapshots[i] for i in together],
                                  layout)
        pieces = output.split([rows[i][1] - rows[i][0] for i in together]) if len(together) > 1 else [output]
        for i, piece, state in zip(together, pieces, made):
            outputs[i], states[i] = piece, state
    for i in sorted(set(range(len(works))) - set(together)):
        outputs[i], states[i] = _linear_runs(mixer, token_rows(proj, *rows[i]), works[i], index, snapshots[i])
    return mixer.output(torch.cat(outputs) if len(outputs) > 1 else outputs[0], proj, h.dtype), states


def _linear_runs(mixer: LinearMixer, proj: Any, work: "CombineWork", index: int,
                 snapshots: dict[int, dict]) -> tuple[torch.Tensor, LinearLayerState]:
    """One request's recurrence over its runs (varlen token-wise work first), composing the
    interiors spliced since the previous run before each; returns its outputs [N, H, V] and state.
    Records the layer's state in ``snapshots[p]`` for every requested position p (inside or at the
    end of a piece)."""
    pieces, entries, init, capture = work.pieces, work.entries, work.init.layers[index], work.capture
    assert isinstance(init, LinearLayerState)
    windows, post_conv = conv_windows(mixer, proj.pre_conv, pieces, entries, index, init.conv)
    inputs = mixer.recurrence_inputs(post_conv, proj)
    state, conv, outputs, offset = init.recurrent, init.conv, [], 0
    compose = naive_addition if work.naive else compose_states
    runs_left = iter(windows)
    for piece in pieces:
        end = piece.start + piece.length
        if isinstance(piece, Splice):
            state, conv = compose(state, [_spliced_transition(mixer, entries[piece.segment], index, piece.start)]), \
                _conv_tail(entries[piece.segment], index)
        else:
            window, run_inputs = next(runs_left), inputs.slice(offset, offset + piece.length)
            cuts = tuple(p - piece.start for p in sorted(snapshots) if piece.start < p < end)
            if capture is not None:  # a segment prefilled alone: no snapshots
                result = capture.recur(mixer, index, piece.start, run_inputs, state, window)
            else:
                result = mixer.recur(run_inputs, state, cuts)
            for cut, cut_state in zip(cuts, result.cut_states):
                snapshots[piece.start + cut][index] = LinearLayerState(cut_state, window[cut : cut + mixer.kernel - 1])
            state, conv, offset = result.state, last_rows(window, mixer.kernel - 1), offset + piece.length
            outputs.append(result.output)
        if end in snapshots:
            snapshots[end][index] = LinearLayerState(state, conv)
    # the conv state is a view of the last run's window: a copy of its k-1 rows lets that window go
    return torch.cat(outputs), LinearLayerState(state, conv.clone())


def _spliced_transition(mixer: LinearMixer, entry: SegmentEntry, index: int,
                        start: int) -> tuple[Transition | None, torch.Tensor]:
    """(T_C, S_C|0) of a cached interior in fp32 for a splice whose first token is at ``start``; a layer
    with RoPE inside its state gets S_C|0 turned from the interior's local start (paper eq. 7)."""
    cached = entry.layers[index]
    assert isinstance(cached, LinearInterior)
    transition, zero_start = cached.for_compute()
    if mixer.rotates_state:
        zero_start = mixer.rotate_state(zero_start, start - entry.local_start)
    return transition, zero_start


def _conv_tail(entry: SegmentEntry, index: int) -> torch.Tensor:
    cached = entry.layers[index]
    assert isinstance(cached, LinearInterior)
    return cached.conv_tail


def _attention_layer(mixer: GatedAttention, rope: RotaryEmbedding, h: torch.Tensor, positions: torch.Tensor,
                     context: PassContext, index: int) -> tuple[torch.Tensor, list[AttentionLayerState | WindowLayerState]]:
    """q, k, v and the output projection of every work's tokens at once; each request's attention over
    its own KV (full, or a sliding window's)."""
    proj = mixer.project(h, positions, rope)
    attended, states = [], []
    for number, (work, (lo, hi), taken) in enumerate(zip(context.works, context.rows, context.snapshots)):
        part, init = token_rows(proj, lo, hi), work.init.layers[index]
        if isinstance(init, WindowLayerState):
            out, state = _window_attend(mixer, rope, part, context.positions[number], work, index, init, taken)
        else:
            assert isinstance(init, AttentionLayerState)
            out, state = _full_attend(mixer, rope, part, work, index, init, context.kv(number, index, part.query.dtype))
        attended.append(out)
        states.append(state)
    return mixer.output(torch.cat(attended) if len(attended) > 1 else attended[0], proj.gate), states


def _full_attend(mixer: GatedAttention, rope: RotaryEmbedding, proj: AttentionInputs, work: "CombineWork", index: int,
                 init: AttentionLayerState, plan: KVPlan) -> tuple[torch.Tensor, AttentionLayerState]:
    """Recompute tokens attend causally over L's KV, re-rotated interiors and each other. The pieces'
    keys and values are written into ``init``'s own buffers in place (they grow; nothing held is
    copied): the runs' in one copy, every interior's in another."""
    init.reserve(plan.end)
    init.place(plan.run_slots, proj.key.transpose(0, 1), proj.value.transpose(0, 1))
    if plan.splice_slots is not None:
        keys, values = _rerotated_interiors(rope, work, index, plan)
        init.place(plan.splice_slots, keys, values)
    init.length = plan.end
    if work.capture is not None:
        work.capture.attention(index, init.keys, init.values)
    return mixer.attend(proj.query, plan.runs, init.keys, init.values, plan.groups), init


def _rerotated_interiors(rope: RotaryEmbedding, work: "CombineWork", index: int,
                         plan: KVPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hkv, n, D] of every spliced interior in order, the keys moved from their
    positions in the segment to their positions in the request: one rotation for all of them."""
    cached = [_attention_interior(work.entries, p, index) for p in work.pieces if isinstance(p, Splice)]
    keys = torch.cat([layer.keys for layer in cached], dim=1) if len(cached) > 1 else cached[0].keys
    values = torch.cat([layer.values for layer in cached], dim=1) if len(cached) > 1 else cached[0].values
    assert plan.deltas is not None
    return rope.apply(keys.transpose(0, 1), plan.deltas, scaled=False).transpose(0, 1), values


def _window_attend(mixer: GatedAttention, rope: RotaryEmbedding, proj: AttentionInputs, positions: list[int],
                   work: "CombineWork", index: int, init: WindowLayerState,
                   snapshots: dict[int, dict]) -> tuple[torch.Tensor, WindowLayerState]:
    """A sliding-window layer: recompute tokens attend over the window's held keys, the spliced
    interiors' (their last ``window`` tokens, re-rotated) and each other, masked by position; the
    ring then keeps the newest ``window`` of them. Positions are host integers (``positions``: the
    run tokens'): nothing is read back from the device."""
    held_keys, held_values, _ = init.held()
    keys, values, key_positions = [held_keys], [held_values], list(range(init.start, init.length))
    for first, key, value in _pieces_kv(proj, rope, work.pieces, work.entries, index):
        keys.append(key)
        values.append(value)
        key_positions += range(first, first + key.shape[1])
        init.write(key, value, first)
    keys, values = torch.cat(keys, dim=1), torch.cat(values, dim=1)
    if work.capture is not None:
        work.capture.window(index, keys, values, key_positions, init.window)
    _window_snapshots(snapshots, index, keys, values, key_positions, init.window, work.pieces)
    return mixer.attend_at(proj.query, positions, keys, values, key_positions), init


def _window_snapshots(snapshots: dict[int, dict], index: int, keys: torch.Tensor, values: torch.Tensor,
                      key_positions: list[int], window: int, pieces: list[Piece]) -> None:
    """Record the layer's window (the keys and values of the last ``window`` positions) at every
    requested position inside or at the end of these pieces, where all of them are at hand."""
    lo, hi = pieces[0].start, pieces[-1].start + pieces[-1].length
    for position in (p for p in snapshots if lo < p <= hi):
        wanted = [i for i, p in enumerate(key_positions) if position - window <= p < position]
        if len(wanted) == min(position, window):
            rows = torch.tensor(wanted).to(keys.device)
            snapshots[position][index] = WindowLayerState(keys.index_select(1, rows), values.index_select(1, rows),
                                                          window, position)


def _pieces_kv(proj: AttentionInputs, rope: RotaryEmbedding, pieces: list[Piece], entries: dict[int, SegmentEntry],
               index: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Each piece's keys and values [Hkv, n, D] and the position of its first key: a run's from this
    pass's projections, a splice's its cached interior re-rotated (a sliding layer's holds only the
    interior's last tokens, so it starts later than the piece)."""
    spliced, offset = _window_interiors(rope, pieces, entries, index), 0
    for piece in pieces:
        if isinstance(piece, Splice):
            key, value = next(spliced)
            yield piece.start + piece.length - key.shape[1], key, value
        else:
            rows = slice(offset, offset + piece.length)
            yield piece.start, proj.key[rows].transpose(0, 1), proj.value[rows].transpose(0, 1)
            offset += piece.length


def _window_interiors(rope: RotaryEmbedding, pieces: list[Piece], entries: dict[int, SegmentEntry],
                      index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values [Hkv, n, D] of each spliced sliding-window interior (its last tokens) in order,
    the keys moved to their positions in the request: one rotation for all of them."""
    cached, shifts = [], []
    for piece in pieces:
        if isinstance(piece, Splice):
            entry = entries[piece.segment]
            layer = _attention_interior(entries, piece, index)
            cached.append(layer)
            shifts.append((piece.start - entry.local_start, layer.keys.shape[1]))
    if not cached:
        return iter(())
    deltas = torch.tensor([delta for delta, n in shifts for _ in range(n)])
    keys = rope.apply(torch.cat([layer.keys for layer in cached], dim=1).transpose(0, 1), deltas, scaled=False).transpose(0, 1)
    return zip(keys.split([n for _, n in shifts], dim=1), (layer.values for layer in cached))


def _check_pieces(pieces: list[Piece], start: int) -> int:
    """Pieces must tile [start, end) in order and end with a run; returns end."""
    position = start
    for piece in pieces:
        if piece.start != position or piece.length <= 0:
            raise ValueError(f"pieces do not tile the request at position {position}: {piece}")
        position += piece.length
    if not pieces or not isinstance(pieces[-1], Run):
        raise ValueError("the last piece must be a recompute run")
    return position


@dataclass
class CombineWork:
    """One combine pass to run (a chunk of a request's prefill, of a segment's cache-time prefill):
    the recompute tokens of ``pieces`` (positions init.length..) through ``model``. ``init`` is
    consumed: its KV buffers grow in place into the result's state. ``token_ids``: all ids of the
    request so far (at least up to the last piece); ``snapshot_at``: positions where linear states
    are recorded (the private pool's snapshots); ``logits_from``: also the logits of every position
    from there on (all of them must be recomputed)."""

    model: HybridModel
    token_ids: list[int]
    pieces: list[Piece]
    init: RequestState
    entries: dict[int, SegmentEntry] = field(default_factory=dict)
    naive: bool = False
    capture: InteriorCapture | None = None
    need_logits: bool = True
    snapshot_at: list[int] | None = None
    logits_from: int | None = None

    @property
    def tokens(self) -> int:
        """Recompute tokens: what the pass costs."""
        return sum(piece.length for piece in self.pieces if isinstance(piece, Run))

    def checkpoint(self) -> Callable[[], None]:
        """A way back to this work's inputs as they are now, should a batch it runs in fail part way
        (its KV buffers cut back, its sliding-window rings and capture restored): it can then run alone."""
        layers = list(self.init.layers)
        lengths = {i: layer.length for i, layer in enumerate(layers) if isinstance(layer, AttentionLayerState)}
        rings = {i: layer.fork() for i, layer in enumerate(layers) if isinstance(layer, WindowLayerState)}
        capture = self.capture.checkpoint() if self.capture is not None else None

        def restore() -> None:
            self.init.layers[:] = [rings.get(i, layer) for i, layer in enumerate(layers)]
            for i, length in lengths.items():
                layers[i].length = length
            if capture is not None:
                capture()
        return restore


@torch.inference_mode()
def combine(
    model: HybridModel, token_ids: list[int], pieces: list[Piece], init: RequestState,
    entries: dict[int, SegmentEntry] | None = None, *, naive: bool = False,
    capture: InteriorCapture | None = None, need_logits: bool = True, snapshot_at: list[int] | None = None,
    logits_from: int | None = None,
) -> CombineResult:
    """One ``CombineWork`` (see there) run alone."""
    return combine_batch([CombineWork(model, token_ids, pieces, init, entries or {}, naive, capture, need_logits,
                                      snapshot_at, logits_from)])[0]


@torch.inference_mode()
def combine_batch(works: list[CombineWork]) -> list[CombineResult]:
    """Several combine passes (of one model, on independent states) in one pass through the model:
    embeddings, norms, projections, MLP/MoE and logits over all their tokens together; each
    request's recurrence and attention over its own state. Each result equals its pass run alone
    (subnormal floats flushed to zero: ``denormals_flushed``)."""
    with denormals_flushed():
        return _combine_batch(works)


def _combine_batch(works: list[CombineWork]) -> list[CombineResult]:
    model = works[0].model
    ends = [_check_pieces(work.pieces, work.init.length) for work in works]
    snapshots: list[dict[int, dict]] = [{p: {} for p in work.snapshot_at or []} for work in works]
    positions = [[q for p in work.pieces if isinstance(p, Run) for q in range(p.start, p.start + p.length)]
                 for work in works]
    offsets = list(itertools.accumulate((len(p) for p in positions), initial=0))
    rows = list(itertools.pairwise(offsets))
    context = PassContext(works, rows, snapshots, positions, model.device)
    all_positions = torch.tensor([q for at in positions for q in at]).to(model.device)
    x = model.embed(torch.tensor([work.token_ids[q] for work, at in zip(works, positions) for q in at]).to(model.device))
    layers: list[list] = [[] for _ in works]
    for index, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        if layer.is_linear:
            mixed, states = _linear_layer(layer.mixer, h, all_positions, context, index)
        else:
            mixed, states = _attention_layer(layer.mixer, model.rope_of(index), h, all_positions, context, index)
        x = layer.feed_forward(layer.residual(x, h, mixed))
        for held, state in zip(layers, states):
            held.append(state)
    wanted = [i for i, work in enumerate(works) if work.need_logits]
    last = model.logits(x[[rows[i][1] - 1 for i in wanted]]) if wanted else None
    logits = {i: last[n] for n, i in enumerate(wanted)} if last is not None else {}
    results = []
    for i, work in enumerate(works):
        taken = {p: states for p, states in snapshots[i].items() if states}
        row_logits = _row_logits(model, work, x[rows[i][0] : rows[i][1]], positions[i], ends[i])
        state = RequestState(layers[i], ends[i], list(work.token_ids[: ends[i]]))
        results.append(CombineResult(logits.get(i), state, taken, row_logits))
    return results


def _row_logits(model: HybridModel, work: CombineWork, x: torch.Tensor, positions: list[int],
                end: int) -> torch.Tensor | None:
    """The logits of every position from ``work.logits_from`` on, if it asks for them."""
    if work.logits_from is None or end <= work.logits_from:
        return None
    wanted = [row for row, q in enumerate(positions) if q >= work.logits_from]
    if len(wanted) != end - max(work.logits_from, work.init.length):
        raise ValueError(f"logits from position {work.logits_from} need every later token recomputed")
    return model.logits(x[wanted[0] :])


Result = TypeVar("Result")
Steps = Generator[CombineWork | None, CombineResult | None, Result]
"""A stepwise computation: it yields each combine pass it needs (a ``CombineWork``, to be sent its
``CombineResult``) or None (a pause: nothing to run, send None), and returns its result. A serving
loop runs the passes of several such computations together; ``drain`` runs one alone."""


def combine_chunked(
    model: HybridModel, token_ids: list[int], pieces: list[Piece], init: RequestState,
    entries: dict[int, SegmentEntry] | None = None, *, chunk_tokens: int, naive: bool = False,
    capture: InteriorCapture | None = None, need_logits: bool = True, snapshot_at: list[int] | None = None,
    logits_from: int | None = None,
) -> Steps[CombineResult]:
    """``combine`` in chunks of at most ``chunk_tokens`` recompute tokens, each asked for as a
    ``CombineWork`` (a serving loop decodes other requests between them); returns the same
    ``CombineResult``."""
    groups = chunk_pieces(pieces, chunk_tokens)
    state, snapshots, logits, rows = init, {}, None, []
    for number, group in enumerate(groups):
        last = number == len(groups) - 1
        result = yield CombineWork(model, token_ids, group, state, entries or {}, naive, capture,
                                   need_logits and last, snapshot_at, logits_from)
        assert result is not None
        state, logits = result.state, result.logits
        snapshots.update(result.snapshots)
        rows += [result.row_logits] if result.row_logits is not None else []
    return CombineResult(logits, state, snapshots, torch.cat(rows) if rows else None)


def drain(steps: Steps[Result]) -> Result:
    """Run a stepwise computation to the end, each combine pass it asks for alone; returns its result."""
    reply: CombineResult | None = None
    while True:
        try:
            work = steps.send(reply)
        except StopIteration as done:
            return done.value
        reply = None if work is None else combine_batch([work])[0]
