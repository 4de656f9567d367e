"""Linear-attention algebra: segment transitions (T_C, compact per family) and state composition.

Recurrence per head: S_t = T_t S_{t-1} + u_t with S in R^{K x V}. For a segment C the pair
(T_C, S_C|0) lets any prefix state S be advanced in O(1) of |C|: S' = T_C S + S_C|0 (paper eq. 4/6).
"""
from dataclasses import dataclass
from enum import Enum

import torch

from ..state import tensor_bytes


class Family(str, Enum):
    """How T_t (and so T_C) is structured: a scalar, a diagonal, or a dense K x K matrix per head."""

    SCALAR = "scalar"
    DIAGONAL = "diagonal"
    DENSE = "dense"


@dataclass
class Transition:
    """T_C of one layer in compact form: ``value`` is [H] (scalar), [H, K] (diagonal) or [H, K, K] (dense), fp32.

    ``kept``: None, or one flag per head, False for a head whose dense T_C is exactly zero (decayed:
    its gate sum underflowed); ``value`` then holds the kept heads' matrices only, in head order."""

    family: Family
    value: torch.Tensor
    kept: tuple[bool, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The full shape [H, ...] (decayed heads counted), or -1 heads if ``kept`` does not match ``value``."""
        if self.kept is None:
            return tuple(self.value.shape)
        heads = len(self.kept) if sum(self.kept) == self.value.shape[0] else -1
        return (heads, *self.value.shape[1:])

    def _kept_index(self, device: torch.device) -> torch.Tensor:
        assert self.kept is not None
        return torch.tensor([h for h, kept in enumerate(self.kept) if kept], dtype=torch.long, device=device)

    def apply(self, state: torch.Tensor) -> torch.Tensor:
        """T_C S for state [H, K, V]; a decayed head gives zeros without touching its state (T_C = 0
        exactly, so 0 S = 0 for any finite S: the same values as the matrix would give)."""
        if self.kept is None:
            return self._apply(self.value, state)
        index = self._kept_index(state.device)
        out = state.new_zeros(state.shape)
        out[index] = self._apply(self.value, state[index])
        return out

    def _apply(self, value: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        if self.family is Family.SCALAR:
            return value[:, None, None] * state
        if self.family is Family.DIAGONAL:
            return value[:, :, None] * state
        return value @ state

    def full_value(self) -> torch.Tensor:
        """``value`` of every head, decayed ones as zeros."""
        if self.kept is None:
            return self.value
        full = self.value.new_zeros(self.shape)
        full[self._kept_index(self.value.device)] = self.value
        return full

    def then(self, later: "Transition") -> "Transition":
        """The transition of this segment followed by ``later``: T_later T_self."""
        if self.family is not later.family:
            raise ValueError(f"cannot chain a {self.family.value} and a {later.family.value} transition")
        if self.family is Family.DENSE:
            return Transition(self.family, later.full_value() @ self.full_value())
        return Transition(self.family, later.full_value() * self.full_value())

    def with_value(self, value: torch.Tensor) -> "Transition":
        """The same transition over another tensor (a copy, another dtype or device)."""
        return Transition(self.family, value, self.kept)

    def without_decayed(self) -> "Transition":
        """This transition with its decayed heads flagged instead of stored. A dense head decays when
        every entry of its T_C is exactly zero: only then is dropping it exact for any prefix, since
        a finite fp32 prefix state can be as large as 2^128 and any nonzero entry times that shows."""
        if self.family is not Family.DENSE or self.kept is not None:
            return self
        kept = self.value.flatten(1).ne(0).any(1)
        if bool(kept.all()):
            return self
        return Transition(self.family, self.value[kept].contiguous(), tuple(kept.tolist()))

    @property
    def decayed_heads(self) -> int:
        return 0 if self.kept is None else self.kept.count(False)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.value)


def stacked_values(transitions: list[Transition]) -> torch.Tensor:
    """The values [S, H, ...] of transitions of one structure and shape, fp32, their decayed heads as
    zeros: one stack for any count (a scatter more when some heads are flagged)."""
    if all(t.kept is None for t in transitions):
        return torch.stack([t.value for t in transitions]).float()
    heads = next(len(t.kept) for t in transitions if t.kept is not None)
    rows = [s * heads + h for s, t in enumerate(transitions) for h in range(heads) if t.kept is None or t.kept[h]]
    values = torch.cat([t.value for t in transitions]).float()
    full = values.new_zeros(len(transitions) * heads, *values.shape[1:])
    full.index_copy_(0, torch.tensor(rows, dtype=torch.long, device=values.device), values)
    return full.view(len(transitions), heads, *values.shape[1:])


def scalar_transition(log_decay: torch.Tensor) -> Transition:
    """Closed form for scalar families (RetNet, Lightning, Mamba2): log_decay [T, H] -> prod a_t per head."""
    return Transition(Family.SCALAR, log_decay.float().sum(0).exp())


def diagonal_transition(log_gate: torch.Tensor) -> Transition:
    """Closed form for diagonal families (GLA): log_gate [T, H, K] -> prod g_t per head and channel."""
    return Transition(Family.DIAGONAL, log_gate.float().sum(0).exp())


def compose_states(state: torch.Tensor, segments: list[tuple[Transition, torch.Tensor]]) -> torch.Tensor:
    """Paper eq. (6): S' = T_Cn(...(T_C1 S + S_C1|0)...) + S_Cn|0. state and each S_C|0 [H, K, V]."""
    for transition, zero_start_state in segments:
        state = transition.apply(state) + zero_start_state
    return state


def naive_addition(state: torch.Tensor, segments: list[tuple[Transition, torch.Tensor]]) -> torch.Tensor:
    """The baseline that ignores transitions: S' = S + sum_i S_Ci|0 (structurally wrong, paper eq. 5)."""
    for _, zero_start_state in segments:
        state = state + zero_start_state
    return state
