"""A linear layer's runs in a combine pass: their conv windows, and on CUDA the recurrence of every
run of every request in the batch in one varlen call.

Per-run kernel calls are host-bound on a GPU (0.75 ms of Python and launches each against ~40 us of
GPU work, H100), and a batch of requests multiplies them. So each request's runs are cut at its
snapshot positions into parts; the state entering every part but a request's first follows by
chaining S <- T_r S + S_r|0 across parts (the maps of all requests' non-final parts from one
varlen call) and S <- T_C S + S_C|0 across splices; then one varlen call runs every part of every
request from its entering state.

Which families run together: those whose kernels take varlen runs and whose transitions are dense
(``LinearFamily.apart_because`` is None: Gated DeltaNet). The others (KDA, GLA, Lightning, Mamba2,
scalar_rope: FLA's kernels take cu_seqlens, but no record of theirs declares it yet; and the
scalar and diagonal maps would chain as ``Transition.apply``, not as a matmul) run one kernel call
per run (``assembler._linear_runs``), with the same results. The outputs here are the kernel's
own: a family whose recurrence adds to them (Mamba2's skip) must add that here before it declares
a varlen kernel.
"""
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .cache.composition import compose_states, naive_addition
from .cache.segments import Piece, Run, Splice
from .cache.store import LinearInterior, SegmentEntry
from .kernels.dispatch import run_varlen
from .models.linear import LinearFamily, LinearMixer, last_rows
from .state import LinearLayerState, RequestState


class PassOfRuns(Protocol):
    """What a combine pass tells the recurrence (a ``CombineWork``)."""

    pieces: list[Piece]
    entries: dict[int, SegmentEntry]
    init: RequestState
    naive: bool


def runs_batched(device: torch.device) -> bool:
    """Whether a combine batch runs a linear layer's runs, all requests' together, in varlen calls
    (``recurrences_together``) instead of one call per run: on CUDA, where per-run calls are host-bound."""
    return device.type == "cuda"


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


@dataclass
class RunsOfPass:
    """One request's runs in one linear layer, ready for the varlen calls: their recurrence inputs
    end to end, each run's conv window, and each run's cuts (offsets in the run: 0, the snapshot
    positions inside it, its length), which split it into parts."""

    inputs: Any  # the mixer's recurrence inputs (a dataclass of [N, ...] tensors with .k and .v)
    windows: list[torch.Tensor]
    bounds: list[list[int]]

    @property
    def lengths(self) -> list[int]:
        """The parts' token counts, in order."""
        return [b - a for edges in self.bounds for a, b in itertools.pairwise(edges)]


def prepare_runs(mixer: LinearMixer, proj: Any, work: PassOfRuns, index: int, snapshots: dict[int, dict]) -> RunsOfPass:
    """The conv and the recurrence inputs of ``work``'s runs (``proj``: its tokens' projections)."""
    init = work.init.layers[index]
    assert isinstance(init, LinearLayerState)
    windows, post_conv = conv_windows(mixer, proj.pre_conv, work.pieces, work.entries, index, init.conv)
    runs = [piece for piece in work.pieces if isinstance(piece, Run)]
    bounds = [[0, *(p - run.start for p in sorted(snapshots) if run.start < p < run.start + run.length), run.length]
              for run in runs]
    return RunsOfPass(mixer.recurrence_inputs(post_conv, proj), windows, bounds)


def concat_inputs(inputs: list[Any]) -> Any:
    """Recurrence inputs laid end to end."""
    if len(inputs) == 1:
        return inputs[0]
    names = [field.name for field in dataclasses.fields(inputs[0])]
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


def _chain_maps(family: LinearFamily,
                prepared: list[RunsOfPass]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per request, the maps (``run_maps``) of every part but its last, all from one varlen call
    (None for a request of one part: nothing follows a part of its own)."""
    heads = [runs.lengths[:-1] for runs in prepared]
    if not any(heads):
        return [None] * len(prepared)
    inputs = concat_inputs([runs.inputs.slice(0, sum(lengths)) for runs, lengths in zip(prepared, heads)])
    zero_states, transitions = run_maps(family, inputs, [n for lengths in heads for n in lengths])
    splits = [len(lengths) for lengths in heads]
    return [(z, t) if len(z) else None for z, t in zip(zero_states.split(splits), transitions.split(splits))]


def _entering_states(mixer: LinearMixer, work: PassOfRuns, index: int, runs: RunsOfPass,
                     maps: tuple[torch.Tensor, torch.Tensor] | None, snapshots: dict[int, dict]) -> list[torch.Tensor]:
    """The state entering each of ``work``'s parts, chained through the maps of its parts and the
    transitions of its splices; records every snapshot but one at the pass's end (its last part's
    final state, which only the varlen call gives)."""
    init = work.init.layers[index]
    assert isinstance(init, LinearLayerState) and not mixer.rotates_state  # S_C|0 is composed as cached
    compose = naive_addition if work.naive else compose_states
    state, conv, entering, parts, run = init.recurrent, init.conv, [], len(runs.lengths), 0
    for piece in work.pieces:
        if isinstance(piece, Splice):
            cached = _interior(work.entries, piece, index)
            state, conv = compose(state, [cached.for_compute()]), cached.conv_tail
        else:
            for cut in runs.bounds[run][1:]:
                entering.append(state)
                if len(entering) == parts:
                    return entering
                assert maps is not None
                state = torch.baddbmm(maps[0][len(entering) - 1], maps[1][len(entering) - 1], state)
                conv = runs.windows[run][cut : cut + mixer.kernel - 1]
                if cut < piece.length:
                    snapshots[piece.start + cut][index] = LinearLayerState(state, conv)
            run += 1
        if piece.start + piece.length in snapshots:
            snapshots[piece.start + piece.length][index] = LinearLayerState(state, conv)
    raise ValueError("a combine pass must end with a run")


def recurrences_together(mixer: LinearMixer, projs: list[Any], works: list[PassOfRuns], index: int,
                         snapshots: list[dict[int, dict]]) -> tuple[torch.Tensor, list[LinearLayerState]]:
    """Every run of every work in layer ``index`` (``projs``: each work's token projections) in two
    varlen calls: the non-final parts' maps, then every part from its entering state. Returns the
    outputs [N, Hv, V] of all works' tokens in order and each work's final state; records snapshots."""
    prepared = [prepare_runs(mixer, proj, work, index, taken) for proj, work, taken in zip(projs, works, snapshots)]
    maps = _chain_maps(mixer.family, prepared)
    entering = [state.float() for work, runs, chained, taken in zip(works, prepared, maps, snapshots)
                for state in _entering_states(mixer, work, index, runs, chained, taken)]
    inputs = concat_inputs([runs.inputs for runs in prepared])
    outputs, finals = family_varlen(mixer.family, inputs, [n for runs in prepared for n in runs.lengths],
                                    torch.stack(entering))
    states = []
    for work, runs, last, taken in zip(works, prepared, itertools.accumulate(len(r.lengths) for r in prepared), snapshots):
        conv, end = last_rows(runs.windows[-1], mixer.kernel - 1), work.pieces[-1].start + work.pieces[-1].length
        if end in taken:
            taken[end][index] = LinearLayerState(finals[last - 1], conv)
        states.append(LinearLayerState(finals[last - 1], conv.clone()))
    return outputs, states
