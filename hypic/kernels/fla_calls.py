"""FLA's Triton kernels: found once per kernel (None without the package or a GPU), and their call
on one unbatched run: FLA wants a batch axis and fp32 gates and states; a run's dense transition is
the state from I under zero values."""
import functools
import importlib
from collections.abc import Callable

import torch


@functools.cache
def fla_kernel(module: str, name: str) -> Callable | None:
    """``fla.ops.<module>.<name>``, or None when it cannot run (no package, or no GPU)."""
    if not torch.cuda.is_available():
        return None
    try:
        return getattr(importlib.import_module(f"fla.ops.{module}"), name)
    except (ImportError, AttributeError):  # no FLA, or one without this kernel
        return None


def fla_run(chunk: Callable, inputs: tuple[torch.Tensor, ...], initial_state: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs (q, k, v, g, then e.g. beta), each [T, H, ...]; q, k already l2-normalised where the
    rule wants it (the kernels' use_qk_l2norm_in_kernel stays False) -> o [T, H, V], state [H, K, V] fp32."""
    q, k, v, g, *rest = (x[None] for x in inputs)
    out, state = chunk(
        q, k, v, g.float(), *rest, scale=scale,
        initial_state=None if initial_state is None else initial_state[None].float(), output_final_state=True,
    )
    return out[0].float(), state[0].float()


def fla_transition(chunk: Callable, inputs: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
    """The run's transition T [H, K, K]: its final state from the identity under zero values (FLA's
    kernels bound the value width, so T is not appended to the values as on CPU)."""
    q, k, _, *rest = inputs
    eye = torch.eye(k.shape[-1], device=k.device).expand(k.shape[1], -1, -1)
    return fla_run(chunk, (q, k, torch.zeros_like(k), *rest), eye, scale)[1]
