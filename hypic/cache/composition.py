"""Linear-attention algebra: segment transitions (T_C, compact per family) and state composition.

Recurrence per head: S_t = T_t S_{t-1} + u_t with S in R^{K x V}. For a segment C the pair
(T_C, S_C|0) lets any prefix state S be advanced in O(1) of |C|: S' = T_C S + S_C|0 (paper eq. 4/6).
"""
from dataclasses import dataclass
from enum import Enum

import torch

from ..kernels.gated_delta import gated_delta_rule
from ..state import tensor_bytes


class Family(str, Enum):
    """How T_t (and so T_C) is structured: a scalar, a diagonal, or a dense K x K matrix per head."""

    SCALAR = "scalar"
    DIAGONAL = "diagonal"
    DENSE = "dense"


@dataclass
class Transition:
    """T_C of one layer in compact form: ``value`` is [H] (scalar), [H, K] (diagonal) or [H, K, K] (dense), fp32."""

    family: Family
    value: torch.Tensor

    def apply(self, state: torch.Tensor) -> torch.Tensor:
        """T_C S for state [H, K, V]."""
        if self.family is Family.SCALAR:
            return self.value[:, None, None] * state
        if self.family is Family.DIAGONAL:
            return self.value[:, :, None] * state
        return self.value @ state

    def then(self, later: "Transition") -> "Transition":
        """The transition of this segment followed by ``later``: T_later T_self."""
        if self.family is not later.family:
            raise ValueError(f"cannot chain a {self.family.value} and a {later.family.value} transition")
        if self.family is Family.DENSE:
            return Transition(self.family, later.value @ self.value)
        return Transition(self.family, later.value * self.value)

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.value)


def scalar_transition(log_decay: torch.Tensor) -> Transition:
    """Closed form for scalar families (RetNet, Lightning, Mamba2): log_decay [T, H] -> prod a_t per head."""
    return Transition(Family.SCALAR, log_decay.float().sum(0).exp())


def diagonal_transition(log_gate: torch.Tensor) -> Transition:
    """Closed form for diagonal families (GLA): log_gate [T, H, K] -> prod g_t per head and channel."""
    return Transition(Family.DIAGONAL, log_gate.float().sum(0).exp())


def delta_rule_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          after: Transition | None = None) -> Transition:
    """Dense T_C = prod_t exp(g_t)(I - b_t k_t k_t^T) of the gated delta rule, from the same kernel:
    start from the identity with the written values zeroed. k [T, H, K]; g, beta [T, H].
    ``after``: an earlier segment's transition T_E; then the result is T_C T_E (one pass, no matmul)."""
    steps, heads, dk = k.shape
    start = torch.eye(dk, device=k.device).expand(heads, dk, dk).contiguous() if after is None else after.value
    zeros = torch.zeros(steps, heads, dk, device=k.device)
    _, value = gated_delta_rule(k, k, zeros, g, beta, start)
    return Transition(Family.DENSE, value)


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
