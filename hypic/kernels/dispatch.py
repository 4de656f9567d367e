"""One dispatch for every linear recurrence: the token loop for short runs (decode), FLA's Triton
kernel on CUDA when installed, else the PyTorch chunked form. A family's kernels are one
``RecurrenceKernels`` record; its inputs are a tuple (q, k, v, g, then any more, e.g. beta), each
[T, H, ...], and its state [H, K, V] fp32."""
import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .affine_chain import AffineMaps
from .fla_calls import fla_kernel, fla_run, fla_transition

Tensors = tuple[torch.Tensor, ...]
Run = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (*inputs, initial_state, scale) -> (o, final state)


@dataclass
class ChunkMaps:
    """A recurrence over chunks of tokens (inputs [N, H, C, ...], each chunk zero-padded at its end,
    which leaves a state alone) as maps of the state S entering each chunk: the chunk's outputs are
    ``zero_outputs + entry_queries @ S``, the state after it ``maps`` applied to S (``AffineMaps``:
    an elementwise T for the gated linear attentions, the low-rank D - L R of the delta rules), and
    the state after the first n of its tokens, for each (chunk, n) asked for, ``prefix_maps`` applied
    to S. fp32."""

    entry_queries: torch.Tensor  # [N, H, C, K]
    zero_outputs: torch.Tensor  # [N, H, C, V]
    maps: AffineMaps
    prefix_maps: AffineMaps | None = None


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Subnormal floats (below 1.2e-38) read and made as zero on this thread while inside (x86's DAZ
    and FTZ; elsewhere nothing changes). A document's T_C after a strong decay holds entries of
    1e-45, and products over them take the CPU's slow path: a layer's state chain ran 4x slower on
    x86-64 for terms some 30 orders of magnitude below an fp32 state's resolution."""
    flushed = torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def prefix_decays(cumulative: torch.Tensor, prefixes: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """For chunks' prefixes (chunk [P], tokens n [P]) of a cumulative log decay [N, H, C(, K)]: the
    log decay over each prefix [P, H(, K)], and each token's decay to the prefix's end [P, H, C(, K)]
    (zero for the tokens past it: they take no part in the prefix's state)."""
    chunks, lengths = prefixes
    taken = cumulative.index_select(0, chunks)
    per_key = taken.dim() == 4
    at = (lengths - 1).view(-1, 1, 1, *((1,) if per_key else ())).expand(-1, taken.shape[1], 1, *taken.shape[3:])
    last = taken.gather(2, at)  # [P, H, 1(, K)]
    inside = torch.arange(taken.shape[2], device=taken.device) < lengths[:, None]  # [P, C]
    inside = inside.view(inside.shape[0], 1, inside.shape[1], *((1,) if per_key else ()))
    return last.squeeze(2), (last - taken).masked_fill(~inside, float("-inf")).exp()


def key_scale(key_dim: int) -> float:
    """The delta rules' default query scale, K^-1/2."""
    return key_dim**-0.5


def unit_scale(key_dim: int) -> float:
    """No query scale (the gated linear attentions scale q themselves, or not at all)."""
    return 1.0


@dataclass(frozen=True)
class RecurrenceKernels:
    """A recurrence's kernels over one unbatched run. ``naive``: the token loop, the oracle of the
    others and the path of runs shorter than ``short_run``; ``chunked``: the PyTorch chunked form,
    (*inputs, initial_state, scale, chunk size); ``chunk_maps``: each chunk of many runs as maps of
    its entering state (``ChunkMaps``: what a combine pass chains across chunks and splices); ``fla``: fla.ops.<module>.<name> (None: no FLA
    kernel); ``varlen``: whether that kernel runs several runs laid end to end (cu_seqlens).
    Dense transitions (``naive_transition``: inputs -> T [H, K, K]; ``chunked_with_transition``) come
    with dense families only; the others' are closed-form from their gates."""

    naive: Run
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    chunk_size: Callable[[int, torch.device], int]
    scale: Callable[[int], float] = key_scale  # the scale of a call that names none, from K
    fla: tuple[str, str] | None = None
    varlen: bool = False
    naive_transition: Callable[..., torch.Tensor] | None = None
    chunked_with_transition: Callable[..., Tensors] | None = None
    short_run: int = 4  # below this the token loop beats the chunked form
    chunk_maps: Callable[..., ChunkMaps] | None = None  # (*[N, H, C, ...] chunks, scale, prefixes) -> maps


def _scale(kernels: RecurrenceKernels, inputs: Tensors, scale: float | None) -> float:
    """The call's scale, or the family's default from the key dimension."""
    return kernels.scale(inputs[1].shape[-1]) if scale is None else scale


def _fla(kernels: RecurrenceKernels, q: torch.Tensor) -> Callable | None:
    """FLA's kernel of ``kernels`` when it can run on q's device, else None."""
    return fla_kernel(*kernels.fla) if kernels.fla is not None and q.is_cuda else None


def run_recurrence(kernels: RecurrenceKernels, inputs: Tensors, initial_state: torch.Tensor | None,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One run from ``initial_state`` [H, K, V] (None: zeros): o [T, H, V] fp32, final state fp32."""
    q = inputs[0]
    scale = _scale(kernels, inputs, scale)
    if q.shape[0] < kernels.short_run:
        return kernels.naive(*inputs, initial_state, scale)
    chunk = _fla(kernels, q)
    if chunk is not None:
        return fla_run(chunk, inputs, initial_state, scale)
    return kernels.chunked(*inputs, initial_state, scale, kernels.chunk_size(q.shape[0], q.device))


def run_with_transition(kernels: RecurrenceKernels, inputs: Tensors, initial_state: torch.Tensor,
                        scale: float | None = None) -> Tensors:
    """``run_recurrence`` that also returns the run's dense transition T [H, K, K] (final state =
    T @ initial_state + the final state from zero)."""
    if kernels.naive_transition is None or kernels.chunked_with_transition is None:
        raise ValueError("these kernels have no dense transition: their family's is closed-form")
    q = inputs[0]
    scale = _scale(kernels, inputs, scale)
    if q.shape[0] < kernels.short_run:
        return (*kernels.naive(*inputs, initial_state, scale), kernels.naive_transition(*inputs))
    chunk = _fla(kernels, q)
    if chunk is not None:
        return (*fla_run(chunk, inputs, initial_state, scale), fla_transition(chunk, inputs, scale))
    return kernels.chunked_with_transition(*inputs, initial_state, scale, kernels.chunk_size(q.shape[0], q.device))


def run_varlen(kernels: RecurrenceKernels, inputs: Tensors, lengths: list[int], initial_states: torch.Tensor,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent runs laid end to end (``lengths``, summing to T), run r from ``initial_states[r]``
    [R, H, K, V]: o [T, H, V] fp32 and final states [R, H, K, V] fp32. One FLA launch sequence for
    all runs where the kernel takes cu_seqlens (per-run calls are host-bound on a GPU); elsewhere
    ``run_recurrence`` run by run."""
    scale = _scale(kernels, inputs, scale)
    chunk = _fla(kernels, inputs[0]) if kernels.varlen else None
    if chunk is not None:
        return _fla_varlen(chunk, inputs, lengths, initial_states, scale)
    outputs, finals, ends = [], [], [0, *itertools.accumulate(lengths)]
    for run, (lo, hi) in enumerate(itertools.pairwise(ends)):
        o, final = run_recurrence(kernels, tuple(x[lo:hi] for x in inputs), initial_states[run], scale)
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs), torch.stack(finals)


@functools.lru_cache(maxsize=16)
def run_bounds(lengths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens of runs of these lengths, on the host and on ``device``: the same two tensors for
    every layer of a pass. FLA memoizes its chunk indices by the identity of these tensors, so it
    builds them (a host op that wakes every CPU thread, and a copy) once per shape, not per layer."""
    ends = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
    return ends, ends.to(device)


def _fla_varlen(chunk: Callable, inputs: Tensors, lengths: list[int], initial_states: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's kernel over runs laid end to end: one batch row, the runs' bounds in cu_seqlens."""
    q, k, v, g, *rest = (x[None] for x in inputs)
    host_ends, ends = run_bounds(tuple(lengths), q.device)
    out, finals = chunk(q, k, v, g.float(), *rest, scale=scale, initial_state=initial_states.float(),
                        output_final_state=True, cu_seqlens=ends, cu_seqlens_cpu=host_ends)
    return out[0].float(), finals.float()
