"""What the assembler and decode need from a linear-attention token mixer, whatever its family.

Every family (Gated DeltaNet: dense T; Lightning: scalar T) offers the same steps, token-wise work
first, then the recurrence over runs of consecutive tokens:

- ``project(x, positions)``: per-token projections, with ``pre_conv`` [N, C] (the short conv's inputs;
  positions [N] matter only to a layer that rotates q and k inside its state);
- ``convolve(window)``: a conv window [k-1 + n, C] -> post-conv [n, C] (``kernel`` = 1: no conv);
- ``convolve_step(window)``: [B, k, C] -> [B, C], one token of B requests;
- ``recurrence_inputs(post_conv, proj)``: what the recurrence consumes (``.q``, ``.slice``);
- ``recur(inputs, state, cuts)`` and ``recur_with_transition(inputs, state)``: one run;
- ``step(states, inputs)``: one token of B requests from states [B, H, K, V];
- ``output(o, proj, dtype)``: [N, H, V] -> [N, hidden];
- ``rotates_state``: whether a cached S_C|0 must be turned by ``rotate_state(S, delta)`` before it
  is composed at another start (paper eq. 7: RoPE inside a scalar-decay state).
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


@dataclass
class RunRecurrence:
    """The recurrence over one run: outputs, the state after it, and the states at requested cuts."""

    output: torch.Tensor  # [n, H, V] fp32
    state: torch.Tensor  # [H, K, V] fp32
    cut_states: list[torch.Tensor]


def recur_in_parts(rule: Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]], inputs: Any,
                   state: torch.Tensor, cuts: tuple[int, ...]) -> RunRecurrence:
    """``rule(part, state) -> (o, state)`` over ``inputs`` cut at the offsets ``cuts``."""
    outputs, cut_states, lo = [], [], 0
    for hi in [*cuts, inputs.q.shape[0]]:
        o, state = rule(inputs.slice(lo, hi), state)
        outputs.append(o)
        cut_states.append(state)
        lo = hi
    return RunRecurrence(torch.cat(outputs), state, cut_states[:-1])


def causal_conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv + SiLU over a window [k-1 + n, C] with weight [C, k] -> [n, C]: the sum
    over the k taps of a shifted slice times its weight (k small), no transposed copies."""
    kernel = weight.shape[1]
    n = window.shape[0] - (kernel - 1)
    out = window[:n] * weight[:, 0]
    for tap in range(1, kernel):
        out = out.addcmul_(window[tap : tap + n], weight[:, tap])
    return F.silu(out if bias is None else out + bias)


def causal_conv_step(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One token of B requests: windows [B, k, C] (the last row the new token) -> [B, C]."""
    out = torch.einsum("bkc,ck->bc", window, weight)
    return F.silu(out if bias is None else out + bias)


def last_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` rows of x (none for 0, where ``x[-0:]`` would be all of them)."""
    return x[x.shape[0] - count :]


class LinearMixer(Protocol):
    """The steps above; ``batched_runs``: whether a combine pass may run all runs of a layer in
    one varlen call (Gated DeltaNet on CUDA)."""

    kernel: int
    batched_runs: bool
    rotates_state: bool

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Any: ...

    def convolve(self, window: torch.Tensor) -> torch.Tensor: ...

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor: ...

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: Any) -> Any: ...

    def recur(self, inputs: Any, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence: ...

    def recur_with_transition(self, inputs: Any, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def step(self, states: torch.Tensor, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def output(self, o: torch.Tensor, proj: Any, dtype: torch.dtype) -> torch.Tensor: ...
