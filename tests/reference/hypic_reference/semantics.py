"""HYPIC's semantics, stated as one rule and computed the slow, obvious way.

The rule: every interior token's per-layer inputs are frozen from its segment's isolated
prefill (the segment alone, from position 0). At a linear layer an interior token feeds the
recurrence its isolated k, v, g, beta (conv included) and leaves its isolated pre-conv input in
the conv window of the tokens after it; at a full-attention layer it contributes its isolated
key, rotated at its global position, and its isolated value (so does a linear layer that rotates
its keys inside the state: its isolated k enters the state rotated at the global position). Every other token (L, the seams,
segments without an interior, Q, generated tokens) is recomputed through every layer at its
global position. With no interior this is the plain forward.

A segment of n tokens has head seam max(w, k - 1) (the conv warm-up: those tokens' conv windows
reach into the previous part), tail seam w, and an interior if anything is left between them; the
last prompt token is never interior (its logits start generation).
"""
from dataclasses import dataclass

import torch

from .model import LayerInputs, ReferenceModel, ReferenceState


@dataclass(frozen=True)
class PicRequest:
    """A request's parts as token ids: ``L SEP C1 SEP ... SEP Cn SEP Q``."""

    leading: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    trailing: tuple[int, ...]

    @property
    def token_ids(self) -> list[int]:
        return [t for part in (self.leading, *self.segments, self.trailing) for t in part]


@dataclass(frozen=True)
class Interior:
    """Segment ``segment`` (starting at global ``start``) has its interior at global [lo, hi)."""

    segment: int
    start: int
    lo: int
    hi: int


def interiors(request: PicRequest, seam_width: int, conv_kernel: int) -> list[Interior]:
    """The cached interiors of a request, by the rule in this module's docstring."""
    found, start, total = [], len(request.leading), len(request.token_ids)
    for index, segment in enumerate(request.segments):
        lo, hi = start + max(seam_width, conv_kernel - 1), start + len(segment) - seam_width
        if lo < hi and hi < total:
            found.append(Interior(index, start, lo, hi))
        start += len(segment)
    return found


def isolated_inputs(model: ReferenceModel, tokens: tuple[int, ...]) -> LayerInputs:
    """Each layer's inputs (one row per token) when ``tokens`` are prefilled alone from position 0."""
    return model.run(model.empty_state(), list(tokens))[1]


def prefill(model: ReferenceModel, request: PicRequest, seam_width: int,
            conv_kernel: int) -> tuple[torch.Tensor, ReferenceState]:
    """HYPIC's prefill of ``request``: the last token's logits [vocab] and the state after it.
    Tokens between interiors are recomputed; each interior is absorbed with its isolated inputs."""
    ids, state, position, logits = request.token_ids, model.empty_state(), 0, None
    for interior in interiors(request, seam_width, conv_kernel):
        if position < interior.lo:
            logits = model.run(state, ids[position : interior.lo])[0][-1]
        alone = isolated_inputs(model, request.segments[interior.segment][: interior.hi - interior.start])
        model.absorb(state, [inputs.rows(interior.lo - interior.start, interior.hi - interior.start) for inputs in alone])
        position = interior.hi
    logits = model.run(state, ids[position:])[0][-1]  # never empty: the last token is never interior
    return logits, state


def greedy(model: ReferenceModel, state: ReferenceState, logits: torch.Tensor,
           steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation: the ``steps`` tokens and the logits each was chosen from."""
    tokens, seen = [], []
    for _ in range(steps):
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        logits = model.run(state, [tokens[-1]])[0][-1]
    return tokens, seen
