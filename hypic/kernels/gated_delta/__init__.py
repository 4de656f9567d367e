"""Gated delta rule: one interface, the fastest correct path for the device.

Runs of at least ``SHORT_RUN`` tokens: FLA's chunked Triton kernel on CUDA when installed,
else the PyTorch chunked form (on CPU with chunks of at most 32 tokens, fitted to short runs:
measured faster than 64 at every length). Shorter runs (decode): the token loop on every device.
FLA's fused-recurrent kernel is not used: on an H100 with FLA 0.6 / Triton 3.6 it returned
states off by 300x from a carried initial state (GPU test of issue 4).
"""
import itertools

import torch

from ..fla_calls import fla_kernel, fla_run, fla_transition
from .chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_heads_first, chunk_gated_delta_rule_with_transition
from .naive import naive_gated_delta_rule, naive_transition

FLA_KERNEL = ("gated_delta_rule", "chunk_gated_delta_rule")  # fla.ops.<module>.<name>, on CUDA
SHORT_RUN = 4  # below this the token loop beats the chunk form on CPU
CPU_CHUNK = 32  # the CPU chunk size for long runs; 64 on CUDA (FLA's)


def chunk_size_for(steps: int, device: torch.device) -> int:
    """The chunk size of a run: 64 on CUDA; on CPU the power of two covering the run, at most 32."""
    if device.type == "cuda":
        return 64
    return min(CPU_CHUNK, 1 << max(steps - 1, 1).bit_length())


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, H, K] (l2-normalised, expanded to value heads); v [T, H, V]; g, beta [T, H];
    initial_state [H, K, V]. Returns o [T, H, V] fp32 and final state [H, K, V] fp32."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[0] < SHORT_RUN:
        return naive_gated_delta_rule(q, k, v, g, beta, initial_state, scale)
    chunk = fla_kernel(*FLA_KERNEL) if q.is_cuda else None
    if chunk is not None:
        return fla_run(chunk, q, k, v, g, beta, initial_state, scale)
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state, scale, chunk_size_for(q.shape[0], q.device))


def gated_delta_rule_with_transition(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, initial_state: torch.Tensor,
                                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``gated_delta_rule`` from ``initial_state`` that also returns the run's transition
    T [H, K, K] (final state = T @ initial_state + the final state from zero)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if q.shape[0] < SHORT_RUN:
        return (*naive_gated_delta_rule(q, k, v, g, beta, initial_state, scale), naive_transition(k, g, beta))
    chunk = fla_kernel(*FLA_KERNEL) if q.is_cuda else None
    if chunk is not None:
        return (*fla_run(chunk, q, k, v, g, beta, initial_state, scale), fla_transition(chunk, q, k, g, beta, scale))
    return chunk_gated_delta_rule_with_transition(q, k, v, g, beta, initial_state, scale,
                                                  chunk_size_for(q.shape[0], q.device))


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            lengths: list[int], initial_states: torch.Tensor,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent runs laid end to end (``lengths``, summing to T), run r from ``initial_states[r]``
    [R, H, K, V']: o [T, H, V] fp32 and final states [R, H, K, V] fp32 (V' = V). One FLA launch
    sequence for all runs on CUDA (what the many short seam runs of a combine pass need: per-run
    calls are host-bound there); elsewhere ``gated_delta_rule`` run by run."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    chunk = fla_kernel(*FLA_KERNEL) if q.is_cuda else None
    if chunk is not None:
        ends = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
        out, finals = chunk(q[None], k[None], v[None], g[None].float(), beta[None], scale=scale,
                            initial_state=initial_states.float(), output_final_state=True,
                            cu_seqlens=ends.to(q.device), cu_seqlens_cpu=ends)
        return out[0].float(), finals.float()
    outputs, finals, lo = [], [], 0
    for run, length in enumerate(lengths):
        o, final = gated_delta_rule(q[lo : lo + length], k[lo : lo + length], v[lo : lo + length], g[lo : lo + length],
                                    beta[lo : lo + length], initial_states[run], scale)
        outputs.append(o)
        finals.append(final)
        lo += length
    return torch.cat(outputs), torch.stack(finals)


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated delta rule step for B requests: state [B, H, K, V]; q, k [B, H, K]; v [B, H, V];
    g, beta [B, H]. Returns o [B, H, V] and the new state (the naive kernel's formula, batched)."""
    state = state * g.exp()[..., None, None]
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = (v - recalled) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q * k.shape[-1] ** -0.5, state), state


__all__ = ["gated_delta_step", "gated_delta_rule", "gated_delta_rule_varlen", "gated_delta_rule_with_transition", "chunk_gated_delta_rule",
           "chunk_gated_delta_rule_heads_first", "chunk_gated_delta_rule_with_transition",
           "naive_gated_delta_rule", "naive_transition", "chunk_size_for"]
