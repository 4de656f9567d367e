"""The states along chains of affine maps over linear-attention states, S_j = T_j S_{j-1} + B_j:
the elements of a combine pass's linear layer (each request's entering state, each chunk of its
recomputed runs, each spliced document) in one program, run with a fixed number of fused ops per
element and none per layer beyond a handful.

A map's T (``AffineMaps``) is a scalar [H] or a diagonal [H, K] per head (Lightning, Mamba2, GLA;
``scale``), a dense [H, K, K] matrix (a cached delta-rule document's T_C; ``dense``), or a chunk of
C tokens of a delta rule in its low-rank form D - L R (``scale`` D, ``left`` L [H, K, C], ``right``
R [H, C, K]): applied as D S - L (R S), C x K x V work instead of K x K x V for C < K, and never
materialised. The states are written where the caller wants them (``ChainStep.target``), so the
state entering every chunk lands in one tensor that the chunks' outputs then read in one batched
product.

An associative scan of the maps ((T2, B2) after (T1, B1) = (T2 T1, T2 B1 + B2)) would take a fixed
number of batched steps whatever the element count, but it moves every state log2 E times and
multiplies maps E log2 E times: on a 2-core x86-64 VM, 51 elements of 8 x 64 x 64 states took 10-30
ms scanned against 1.1-2.6 ms in sequence (scalar, diagonal and dense maps alike). The sequence it is.
"""
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .naive import apply_map, naive_chain


@dataclass
class AffineMaps:
    """n affine maps S -> T S + B of states [H, K, V], all fp32: ``offsets`` B [n, H, K, V] with T
    as ``scale`` [n, H] or [n, H, K] (elementwise) or ``dense`` [n, H, K, K]; or a delta rule's chunk
    S -> D S + L (U - R S), with D ``scale``, L ``left`` [n, H, K, C], R ``right`` [n, H, C, K] and U
    ``values`` [n, H, C, V] (T = D - L R and B = L U, neither formed)."""

    offsets: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def __len__(self) -> int:
        return (self.offsets if self.offsets is not None else self.values).shape[0]  # type: ignore[union-attr]

    def zero_states(self) -> torch.Tensor:
        """B [n, H, K, V]: each map's image of the zero state."""
        return self.offsets if self.offsets is not None else self.left @ self.values  # type: ignore[operator]

    def full(self) -> torch.Tensor:
        """T itself: [n, H] / [n, H, K] elementwise, or [n, H, K, K] (what ``naive_chain`` takes)."""
        if self.dense is not None:
            return self.dense
        assert self.scale is not None
        if self.left is None:
            return self.scale
        eye = torch.eye(self.left.shape[-2], device=self.left.device)
        return _broadcast(self.scale, 4) * eye - self.left @ self.right

    def apply(self, states: torch.Tensor) -> torch.Tensor:
        """T_i states_i + B_i for each i, batched (states [n, H, K, V]), in place on ``states``."""
        flat = states.flatten(0, 1)
        if self.dense is not None:
            return torch.baddbmm(self.offsets.flatten(0, 1), self.dense.flatten(0, 1), flat).view_as(states)
        assert self.scale is not None
        if self.left is None:
            return states.mul_(_broadcast(self.scale, 4)).add_(self.offsets)
        written = torch.baddbmm(self.values.flatten(0, 1), self.right.flatten(0, 1), flat, alpha=-1.0)  # U - R S
        states.mul_(_broadcast(self.scale, 4))
        return flat.baddbmm_(self.left.flatten(0, 1), written).view_as(states)

    def views(self) -> "MapViews":
        """Each map's tensors as views (one unbind per tensor), for a chain applying them one by one."""
        scale = None if self.scale is None else _broadcast(self.scale, 4)
        return MapViews(*(None if t is None else t.unbind(0) for t in (self.offsets, scale, self.dense, self.left,
                                                                         self.right, self.values)))


def _broadcast(scale: torch.Tensor, rank: int) -> torch.Tensor:
    """Elementwise maps [n, H] or [n, H, K] shaped to multiply states [n, H, K, V]."""
    return scale.reshape(*scale.shape, *([1] * (rank - scale.dim())))


@dataclass
class MapViews:
    """n maps as per-map views (``AffineMaps.views``, or each map's own tensors: a cached document's
    T_C and S_C|0 where they lie), for a chain that applies them one at a time."""

    offsets: Sequence[torch.Tensor] | None
    scale: Sequence[torch.Tensor] | None = None  # shaped to multiply a state [H, K, V]
    dense: Sequence[torch.Tensor] | None = None
    left: Sequence[torch.Tensor] | None = None
    right: Sequence[torch.Tensor] | None = None
    values: Sequence[torch.Tensor] | None = None

    def apply_into(self, i: int, state: torch.Tensor, out: torch.Tensor) -> None:
        """out = T_i state + B_i: one fused op (three for a delta rule's chunk)."""
        if self.dense is not None:
            torch.baddbmm(self.offsets[i], self.dense[i], state, out=out)  # type: ignore[index]
            return
        assert self.scale is not None
        if self.left is None:
            torch.addcmul(self.offsets[i], self.scale[i], state, out=out)  # type: ignore[index]
            return
        assert self.right is not None and self.values is not None
        written = torch.baddbmm(self.values[i], self.right[i], state, alpha=-1.0)  # U - R S
        torch.baddbmm(torch.mul(state, self.scale[i]), self.left[i], written, out=out)


@dataclass(frozen=True)
class ChainStep:
    """One element of a chain: its map (``family`` "unit" or "splice", ``index`` in it; "start": no
    map, the state is ``starts[index]``; "add": the splice's B added without T), the state it
    continues (``source``: a (buffer, row) written by an earlier step; None for a start) and where
    its state goes (``target``: buffer "entering" or "other", row)."""

    family: str
    index: int
    source: tuple[str, int] | None
    target: tuple[str, int]


def run_chain(steps: list[ChainStep], starts: torch.Tensor, units: AffineMaps, splices: MapViews | None,
              buffers: dict[str, torch.Tensor]) -> None:
    """Every step's state into its target row of ``buffers`` (states [rows, H, K, V] fp32): starts
    [W, H, K, V], then each step's map applied to the state it continues."""
    views = {"unit": units.views(), "splice": splices}
    rows = {name: buffer.unbind(0) for name, buffer in buffers.items()}
    start_rows = starts.unbind(0)
    for step in steps:
        out = rows[step.target[0]][step.target[1]]
        if step.source is None:
            out.copy_(start_rows[step.index])
            continue
        state = rows[step.source[0]][step.source[1]]
        if step.family == "add":
            torch.add(state, views["splice"].offsets[step.index], out=out)  # type: ignore[union-attr,index]
        else:
            views[step.family].apply_into(step.index, state, out)  # type: ignore[union-attr]


__all__ = ["AffineMaps", "ChainStep", "MapViews", "apply_map", "naive_chain", "run_chain"]
