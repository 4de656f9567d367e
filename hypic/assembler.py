"""The combine pass (DESIGN §5): run only the recompute tokens through every layer, splicing
cached segment interiors in between.

One code path serves full prefill (a single run from position 0), segment prefill (a single run
with an ``InteriorCapture``), the HYPIC combine pass (runs and splices) and decode (one-token runs).
"""
import itertools
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .composition import Transition, compose_states, naive_addition
from .kernels.gated_delta import gated_delta_rule_varlen
from .models import HybridModel
from .models.attention import AttentionInputs, GatedAttention
from .models.gated_deltanet import GatedDeltaNet, RecurrenceInputs
from .models.linear import LinearMixer, RunRecurrence, last_rows
from .models.rope import RotaryEmbedding
from .segments import Piece, Run, Splice, chunk_pieces
from .state import AttentionLayerState, LinearLayerState, RequestState, WindowLayerState
from .store import AttentionInterior, InteriorLayer, LinearInterior, SegmentEntry


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

    def window(self, index: int, keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor,
               window: int) -> None:
        """A sliding-window layer keeps only its interior's last ``window`` tokens' K and V: no later
        token sees further back (``key_positions`` [T]: the positions of keys / values [Hkv, T, D])."""
        if index in self.layers or not bool((key_positions == self.hi - 1).any()):
            return
        wanted = (key_positions >= max(self.lo, self.hi - window)) & (key_positions < self.hi)
        self.layers[index] = AttentionInterior(keys[:, wanted].clone(), values[:, wanted].clone())

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


def _run_positions(pieces: list[Piece], device: torch.device) -> torch.Tensor:
    runs = [torch.arange(p.start, p.start + p.length) for p in pieces if isinstance(p, Run)]
    return torch.cat(runs).to(device)


def _conv_windows(mixer: LinearMixer, pre_conv: torch.Tensor, pieces: list[Piece], entries: dict[int, SegmentEntry],
                  index: int, conv: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each run's conv window (the k-1 inputs before it: the previous run's, or a spliced interior's
    cached tail; then its own), as views of one tensor, and the post-conv rows of all runs [N, C].
    One convolution covers every window laid end to end; the rows straddling two windows are dropped."""
    parts, lengths, offset, width = [], [], 0, mixer.kernel - 1
    for piece in pieces:
        if isinstance(piece, Splice):
            cached = entries[piece.segment].layers[index]
            assert isinstance(cached, LinearInterior)
            conv = cached.conv_tail
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


def runs_batched(device: torch.device) -> bool:
    """Whether a combine pass runs a linear layer's runs in one varlen call (chaining their states
    through transitions first) instead of one call per run: on CUDA, where per-run calls are
    host-bound (0.75 ms of Python and launches each against ~40 us of GPU work, H100)."""
    return device.type == "cuda"


def _batched_recurrence(mixer: GatedDeltaNet, inputs: RecurrenceInputs, pieces: list[Piece],
                        entries: dict[int, SegmentEntry], index: int, state: torch.Tensor, naive: bool,
                        windows: list[torch.Tensor], snapshots: dict[int, dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """All runs of a linear layer in two varlen calls, each run cut at the snapshot positions inside
    it. First every part from zero (its S_r|0) and from I with zero values (its transition T_r) at
    once; then the state entering each part follows by chaining S <- T_r S + S_r|0 across parts and
    S <- T_C S + S_C|0 across splices; then every part from its entering state. Returns the outputs
    [N, Hv, V] and the final state; records the snapshots."""
    runs = [piece for piece in pieces if isinstance(piece, Run)]
    bounds = [[0, *(p - run.start for p in sorted(snapshots) if run.start < p < run.start + run.length), run.length]
              for run in runs]
    lengths = [b - a for edges in bounds for a, b in itertools.pairwise(edges)]
    zero_states, transitions = _run_maps(inputs, lengths)
    compose = naive_addition if naive else compose_states
    entering, run = [], 0
    for piece in pieces:
        if isinstance(piece, Splice):
            cached = entries[piece.segment].layers[index]
            assert isinstance(cached, LinearInterior)
            state, conv = compose(state, [cached.for_compute()]), cached.conv_tail
        else:
            for cut in bounds[run][1:]:
                entering.append(state)
                part = len(entering) - 1
                state = torch.baddbmm(zero_states[part], transitions[part], state)
                conv = windows[run][cut : cut + mixer.kernel - 1]
                if cut < piece.length:
                    snapshots[piece.start + cut][index] = LinearLayerState(state, conv)
            run += 1
        if piece.start + piece.length in snapshots:
            snapshots[piece.start + piece.length][index] = LinearLayerState(state, conv)
    outputs, finals = gated_delta_rule_varlen(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, lengths,
                                              torch.stack(entering))
    return outputs, finals[-1]


def _run_maps(inputs: RecurrenceInputs, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's affine map S -> T_r S + S_r|0: S_r|0 [R, H, K, V] and T_r [R, H, K, K]. One varlen
    call runs every run twice (from zero with its values; from I with zero values) when K = V."""
    runs, heads, dim = len(lengths), inputs.k.shape[1], inputs.k.shape[2]
    zeros = inputs.v.new_zeros(runs, heads, dim, inputs.v.shape[2])
    eye = torch.eye(dim, device=inputs.k.device).expand(runs, heads, dim, dim)
    if inputs.v.shape[2] == dim:
        twice = lambda x, y: torch.cat([x, y])  # noqa: E731
        _, finals = gated_delta_rule_varlen(twice(inputs.q, inputs.q), twice(inputs.k, inputs.k),
                                            twice(inputs.v, torch.zeros_like(inputs.v)), twice(inputs.g, inputs.g),
                                            twice(inputs.beta, inputs.beta), lengths * 2, torch.cat([zeros, eye]))
        return finals[:runs], finals[runs:]
    _, zero_states = gated_delta_rule_varlen(inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta, lengths, zeros)
    _, transitions = gated_delta_rule_varlen(inputs.q, inputs.k, torch.zeros_like(inputs.k), inputs.g, inputs.beta,
                                             lengths, eye)
    return zero_states, transitions


def _linear_layer(
    mixer: LinearMixer, h: torch.Tensor, positions: torch.Tensor, pieces: list[Piece], entries: dict[int, SegmentEntry],
    index: int, init: LinearLayerState, naive: bool, capture: InteriorCapture | None, snapshots: dict[int, dict],
) -> tuple[torch.Tensor, LinearLayerState]:
    """Token-wise work runs once over all runs (varlen); per run only the recurrence, composing
    the interiors spliced since the previous run first. Records the layer's state in
    ``snapshots[p]`` for every requested position p (inside or at the end of a piece)."""
    proj = mixer.project(h, positions)
    windows, post_conv = _conv_windows(mixer, proj.pre_conv, pieces, entries, index, init.conv)
    inputs = mixer.recurrence_inputs(post_conv, proj)
    parts = sum(isinstance(piece, Run) for piece in pieces) + sum(
        piece.start < p < piece.start + piece.length for piece in pieces if isinstance(piece, Run) for p in snapshots)
    if parts > 1 and capture is None and mixer.batched_runs and runs_batched(h.device):
        assert isinstance(mixer, GatedDeltaNet)
        output, state = _batched_recurrence(mixer, inputs, pieces, entries, index, init.recurrent, naive, windows,
                                            snapshots)
        return mixer.output(output, proj, h.dtype), LinearLayerState(state, last_rows(windows[-1], mixer.kernel - 1).clone())
    state, conv, outputs, offset = init.recurrent, init.conv, [], 0
    compose = naive_addition if naive else compose_states
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
    return mixer.output(torch.cat(outputs), proj, h.dtype), LinearLayerState(state, conv.clone())


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


def _attention_layer(
    mixer: GatedAttention, rope: RotaryEmbedding, h: torch.Tensor, positions: torch.Tensor, pieces: list[Piece],
    entries: dict[int, SegmentEntry], index: int, init: AttentionLayerState, capture: InteriorCapture | None,
) -> tuple[torch.Tensor, AttentionLayerState]:
    """Recompute tokens attend causally over L's KV, re-rotated interiors and each other. The pieces'
    keys and values are appended to ``init`` in place (its buffers grow; nothing held is copied)."""
    proj = mixer.project(h, positions, rope)
    pieces_kv = list(_pieces_kv(proj, rope, pieces, entries, index))
    keys, values = [kv[1] for kv in pieces_kv], [kv[2] for kv in pieces_kv]
    init.reserve(init.length + sum(piece.length for piece in pieces))
    init.append(torch.cat(keys, dim=1), torch.cat(values, dim=1))  # one copy into the buffer
    if capture is not None:
        capture.attention(index, init.keys, init.values)
    attended = mixer.attend(proj.query, [(p.start, p.length) for p in pieces if isinstance(p, Run)], init.keys,
                            init.values)
    return mixer.output(attended, proj.gate), init


def _window_layer(
    mixer: GatedAttention, rope: RotaryEmbedding, h: torch.Tensor, positions: torch.Tensor, pieces: list[Piece],
    entries: dict[int, SegmentEntry], index: int, init: WindowLayerState, capture: InteriorCapture | None,
    snapshots: dict[int, dict],
) -> tuple[torch.Tensor, WindowLayerState]:
    """A sliding-window layer: recompute tokens attend over the window's held keys, the spliced
    interiors' (their last ``window`` tokens, re-rotated) and each other, masked by position; the
    ring then keeps the newest ``window`` of them."""
    proj = mixer.project(h, positions, rope)
    held_keys, held_values, held_positions = init.held()
    keys, values, key_positions = [held_keys], [held_values], [held_positions]
    for first, key, value in _pieces_kv(proj, rope, pieces, entries, index):
        keys.append(key)
        values.append(value)
        key_positions.append(torch.arange(first, first + key.shape[1], device=positions.device))
        init.write(key, value, first)
    keys, values, key_positions = torch.cat(keys, dim=1), torch.cat(values, dim=1), torch.cat(key_positions)
    if capture is not None:
        capture.window(index, keys, values, key_positions, init.window)
    _window_snapshots(snapshots, index, keys, values, key_positions, init.window, pieces)
    attended = mixer.attend_at(proj.query, positions, keys, values, key_positions)
    return mixer.output(attended, proj.gate), init


def _window_snapshots(snapshots: dict[int, dict], index: int, keys: torch.Tensor, values: torch.Tensor,
                      key_positions: torch.Tensor, window: int, pieces: list[Piece]) -> None:
    """Record the layer's window (the keys and values of the last ``window`` positions) at every
    requested position inside or at the end of these pieces, where all of them are at hand."""
    lo, hi = pieces[0].start, pieces[-1].start + pieces[-1].length
    for position in (p for p in snapshots if lo < p <= hi):
        wanted = (key_positions >= position - window) & (key_positions < position)
        if int(wanted.sum()) == min(position, window):
            snapshots[position][index] = WindowLayerState(keys[:, wanted], values[:, wanted], window, position)


def _pieces_kv(proj: AttentionInputs, rope: RotaryEmbedding, pieces: list[Piece], entries: dict[int, SegmentEntry],
               index: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Each piece's keys and values [Hkv, n, D] and the position of its first key: a run's from this
    pass's projections, a splice's its cached interior re-rotated (a sliding layer's holds only the
    interior's last tokens, so it starts later than the piece)."""
    spliced, offset = _rerotated_interiors(rope, pieces, entries, index), 0
    for piece in pieces:
        if isinstance(piece, Splice):
            key, value = next(spliced)
            yield piece.start + piece.length - key.shape[1], key, value
        else:
            rows = slice(offset, offset + piece.length)
            yield piece.start, proj.key[rows].transpose(0, 1), proj.value[rows].transpose(0, 1)
            offset += piece.length


def _rerotated_interiors(rope: RotaryEmbedding, pieces: list[Piece], entries: dict[int, SegmentEntry],
                         index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values [Hkv, n, D] of each spliced interior in order, the keys moved from their
    positions in the segment to their positions in the request: one rotation for all of them."""
    cached, shifts = [], []
    for piece in pieces:
        if isinstance(piece, Splice):
            entry = entries[piece.segment]
            layer = entry.layers[index]
            assert isinstance(layer, AttentionInterior)
            cached.append(layer)
            shifts.append((piece.start - entry.local_start, layer.keys.shape[1]))
    if not cached:
        return iter(())
    deltas = torch.tensor([delta for delta, _ in shifts]).repeat_interleave(torch.tensor([n for _, n in shifts]))
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


@torch.inference_mode()
def combine(
    model: HybridModel, token_ids: list[int], pieces: list[Piece], init: RequestState,
    entries: dict[int, SegmentEntry] | None = None, *, naive: bool = False,
    capture: InteriorCapture | None = None, need_logits: bool = True, snapshot_at: list[int] | None = None,
    logits_from: int | None = None,
) -> CombineResult:
    """Run the recompute tokens of ``pieces`` (positions init.length..) through the model. ``init``
    is consumed: its KV buffers grow in place into the returned state.
    token_ids: all ids of the request so far (at least up to the last piece). ``snapshot_at``:
    positions where linear states are recorded (the private pool's snapshots). ``logits_from``:
    also return the logits of every position from there on (all of them must be recomputed)."""
    end = _check_pieces(pieces, init.length)
    snapshots: dict[int, dict] = {p: {} for p in snapshot_at or []}
    entries = entries or {}
    positions = _run_positions(pieces, model.device)
    x = model.embed(torch.tensor(token_ids, device=model.device)[positions])
    layers = []
    for index, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        if layer.is_linear:
            mixed, layer_state = _linear_layer(layer.mixer, h, positions, pieces, entries, index, init.layers[index], naive,
                                               capture, snapshots)
        else:
            args = (layer.mixer, model.rope_of(index), h, positions, pieces, entries, index, init.layers[index], capture)
            if isinstance(init.layers[index], WindowLayerState):
                mixed, layer_state = _window_layer(*args, snapshots)
            else:
                mixed, layer_state = _attention_layer(*args)
        x = layer.feed_forward(layer.residual(x, h, mixed))
        layers.append(layer_state)
    logits = model.logits(x[-1:])[0] if need_logits else None
    taken = {p: states for p, states in snapshots.items() if states}
    rows = None
    if logits_from is not None and end > logits_from:
        wanted = positions >= logits_from
        if int(wanted.sum()) != end - max(logits_from, init.length):
            raise ValueError(f"logits from position {logits_from} need every later token recomputed")
        rows = model.logits(x[wanted])
    return CombineResult(logits, RequestState(layers, end, list(token_ids[:end])), taken, rows)


def combine_chunked(
    model: HybridModel, token_ids: list[int], pieces: list[Piece], init: RequestState,
    entries: dict[int, SegmentEntry] | None = None, *, chunk_tokens: int, naive: bool = False,
    capture: InteriorCapture | None = None, need_logits: bool = True, snapshot_at: list[int] | None = None,
    logits_from: int | None = None,
) -> Generator[None, None, CombineResult]:
    """``combine`` in chunks of at most ``chunk_tokens`` recompute tokens, yielding between chunks
    so that a serving loop can decode other requests meanwhile; returns the same ``CombineResult``."""
    groups = chunk_pieces(pieces, chunk_tokens)
    state, snapshots, logits, rows = init, {}, None, []
    for number, group in enumerate(groups):
        if number:
            yield
        last = number == len(groups) - 1
        result = combine(model, token_ids, group, state, entries, naive=naive, capture=capture,
                         need_logits=need_logits and last, snapshot_at=snapshot_at, logits_from=logits_from)
        state, logits = result.state, result.logits
        snapshots.update(result.snapshots)
        rows += [result.row_logits] if result.row_logits is not None else []
    return CombineResult(logits, state, snapshots, torch.cat(rows) if rows else None)


Result = TypeVar("Result")


def drain(steps: Generator[None, None, Result]) -> Result:
    """Run a stepwise computation (see ``combine_chunked``) to the end; returns its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
