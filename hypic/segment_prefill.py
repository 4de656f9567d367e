"""Cache-time prefill: a PIC segment alone from position 0, keeping only its interior."""
from collections.abc import Generator

from .assembler import InteriorCapture, combine_chunked, drain
from .models import HybridModel
from .segments import Run
from .state import RequestState
from .store import InteriorLayer

UNCHUNKED = 1 << 62


def prefill_interior_steps(model: HybridModel, token_ids: tuple[int, ...], seam_width: int,
                           chunk_tokens: int = UNCHUNKED) -> Generator[None, None, list[InteriorLayer]]:
    """Per layer: (T_I, S_I|0, conv tail) for linear layers, 0-based K and V for full layers, over
    the interior [w, |C| - w). Requires |C| > 2w. Runs in chunks of ``chunk_tokens``, yielding between."""
    length = len(token_ids)
    if length <= 2 * seam_width:
        raise ValueError(f"a segment of {length} tokens has no interior at seam width {seam_width}")
    capture = InteriorCapture(seam_width, length - seam_width)
    empty = RequestState.empty(model.config, model.device, model.dtype)
    yield from combine_chunked(model, list(token_ids), [Run(0, length)], empty, chunk_tokens=chunk_tokens,
                               capture=capture, need_logits=False)
    return [capture.layers[i] for i in range(len(model.layers))]


def prefill_interior(model: HybridModel, token_ids: tuple[int, ...], seam_width: int) -> list[InteriorLayer]:
    """``prefill_interior_steps`` in one go."""
    return drain(prefill_interior_steps(model, token_ids, seam_width))
