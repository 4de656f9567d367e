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
  is composed at another start (RoPE inside a scalar-decay state).

A family is one ``LinearFamily`` record (its mixer, kernels, transition structure, state shape and
checkpoint names), registered in ``hypic.models.families``; the mixer it builds carries it (``family``).
"""
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..cache.composition import Family
from ..config import ModelConfig
from ..kernels.dispatch import RecurrenceKernels
from ..state import LinearShapes
from ..loading.tensor_sources import Direct, Source

Tensors = tuple[torch.Tensor, ...]


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
    taps = weight.t().contiguous()  # each tap's weights contiguous: a strided column is ~5x slower to broadcast
    out = window[:n] * taps[0]
    for tap in range(1, kernel):
        out = out.addcmul_(window[tap : tap + n], taps[tap])
    return F.silu(out if bias is None else out + bias)


def causal_conv_step(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """One token of B requests: windows [B, k, C] (the last row the new token) -> [B, C]."""
    out = torch.einsum("bkc,ck->bc", window, weight)
    return F.silu(out if bias is None else out + bias)


def last_rows(x: torch.Tensor, count: int) -> torch.Tensor:
    """The last ``count`` rows of x (none for 0, where ``x[-0:]`` would be all of them)."""
    return x[x.shape[0] - count :]


class LinearMixer(Protocol):
    """The steps above; ``family``: the record the mixer was built from (``LinearFamily.build``)."""

    kernel: int
    family: "LinearFamily"
    rotates_state: bool

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Any: ...

    def convolve(self, window: torch.Tensor) -> torch.Tensor: ...

    def convolve_step(self, window: torch.Tensor) -> torch.Tensor: ...

    def recurrence_inputs(self, post_conv: torch.Tensor, proj: Any) -> Any: ...

    def recur(self, inputs: Any, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence: ...

    def recur_with_transition(self, inputs: Any, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def step(self, states: torch.Tensor, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def output(self, o: torch.Tensor, proj: Any, dtype: torch.dtype) -> torch.Tensor: ...


def value_head_state(config: ModelConfig) -> tuple[int, ...]:
    """A state of K x V per value head: [Hv, K, V]."""
    return (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)


def any_native_fields(text: dict[str, Any]) -> None:
    """A ``hypic_hybrid`` config of this family needs nothing beyond Qwen3.5's fields."""


@dataclass(frozen=True)
class LinearFamily:
    """One linear-attention family: the value of ``ModelConfig.linear_family`` (``name``), the token
    mixer it builds (``mixer(config, layer index)``), its ``kernels``, the structure of its
    transitions (scalar: T_C [H]; diagonal: [H, K]; dense: [H, K, K]), which of a mixer's
    recurrence inputs its kernels take, in their order (``kernel_args``), where its parameters come
    from in a checkpoint (a layer's tensors under ``checkpoint_group``, e.g. layers.3.linear_attn.*,
    become sources of our names by ``checkpoint(config, layer prefix, short name -> key)``), whether a
    ``hypic_hybrid`` config may name it (``native``: raises ``UnsupportedModel`` when the config's
    fields do not fit; None: it may not), its recurrent state per layer (``state_shape``,
    ``state_dtype``), and what its mixer adds to the kernels' outputs (``skip``: a function of the
    recurrence inputs; None: nothing)."""

    name: str
    mixer: Callable[[ModelConfig, int], LinearMixer]
    kernels: RecurrenceKernels
    structure: Family
    kernel_args: Callable[[Any], Tensors]
    checkpoint_group: str
    checkpoint: Callable[[ModelConfig, str, dict[str, str]], dict[str, Source]]
    native: Callable[[dict[str, Any]], None] | None = None
    state_shape: Callable[[ModelConfig], tuple[int, ...]] = value_head_state
    state_dtype: torch.dtype = torch.float32
    skip: Callable[[Any], torch.Tensor] | None = None  # what the mixer adds to the kernels' outputs (Mamba2's D x)

    def with_skip(self, outputs: torch.Tensor, inputs: Any) -> torch.Tensor:
        """The kernels' outputs [N, H, V] of ``inputs`` with what the mixer adds to them (``skip``)."""
        return outputs if self.skip is None else outputs + self.skip(inputs)

    def build(self, config: ModelConfig, index: int) -> LinearMixer:
        """Layer ``index``'s mixer, which carries this record."""
        mixer = self.mixer(config, index)
        mixer.family = self
        return mixer

    @property
    def apart_because(self) -> str | None:
        """Why a combine pass runs each of a layer's runs in a call of its own; None: all runs of a
        layer go in one varlen call (``hypic.runs_together``), which needs a varlen kernel and
        chains dense maps."""
        if not self.kernels.varlen:
            return f"{self.name} has no varlen kernel"
        if self.structure is not Family.DENSE:
            return f"{self.name}'s transitions are {self.structure.value}: runs_together chains dense maps only"
        return None

    def transition_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """Shape of a cached T_C per linear layer."""
        heads, keys = self.state_shape(config)[:2]
        return {Family.SCALAR: (heads,), Family.DIAGONAL: (heads, keys), Family.DENSE: (heads, keys, keys)}[
            self.structure]

    def shapes(self, config: ModelConfig) -> LinearShapes:
        """What each linear layer of ``config`` holds: its state's shape and dtype, a T_C's shape."""
        return LinearShapes(self.state_shape(config), self.state_dtype, self.transition_shape(config))

    def state_elements(self, config: ModelConfig) -> int:
        return math.prod(self.state_shape(config))

    def state_nbytes(self, config: ModelConfig) -> int:
        return self.state_elements(config) * self.state_dtype.itemsize


def qkvg(inputs: Any) -> Tensors:
    """The kernel inputs of a gated linear attention: q, k, v, g."""
    return inputs.q, inputs.k, inputs.v, inputs.g


def qkvg_beta(inputs: Any) -> Tensors:
    """The kernel inputs of a delta rule: q, k, v, g, beta."""
    return inputs.q, inputs.k, inputs.v, inputs.g, inputs.beta


def direct_sources(config: ModelConfig, prefix: str, keys: dict[str, str]) -> dict[str, Source]:
    """A layer whose checkpoint names are ours: each tensor fills the mixer's parameter of its name."""
    return {f"{prefix}mixer.{name}": Direct(key) for name, key in keys.items()}
