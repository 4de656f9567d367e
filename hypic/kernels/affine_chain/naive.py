"""Element by element reference of a chain of affine maps over linear-attention states: the oracle
of the batched forms beside it."""
import torch


def apply_map(transition: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """T S for a state [..., H, K, V] and T of [..., H] (scalar), [..., H, K] (diagonal) or
    [..., H, K, K] (dense): the structure is read from T's rank against the state's."""
    extra = transition.dim() - (state.dim() - 2)
    if extra == 0:
        return transition[..., None, None] * state
    if extra == 1:
        return transition[..., None] * state
    return transition @ state


def naive_chain(transitions: torch.Tensor, zero_states: torch.Tensor) -> torch.Tensor:
    """The state after each element of S_j = T_j S_{j-1} + B_j from S_{-1} = 0: transitions [E, H(, K(, K))],
    zero_states B [E, H, K, V] -> states [E, H, K, V] fp32. An element whose T is zero starts a chain
    afresh (its state is its B), so several requests' chains can be laid end to end."""
    states, state = [], torch.zeros_like(zero_states[0], dtype=torch.float32)
    for transition, zero_state in zip(transitions.float(), zero_states.float()):
        state = apply_map(transition, state) + zero_state
        states.append(state)
    return torch.stack(states)
