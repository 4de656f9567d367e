"""Cache-time prefill: a PIC segment alone from position 0, keeping only its interior;
a leading segment in full."""
from .assembler import InteriorCapture, combine
from .models import HybridModel
from .segments import Run
from .state import RequestState
from .store import InteriorLayer


def prefill_interior(model: HybridModel, token_ids: tuple[int, ...], seam_width: int) -> list[InteriorLayer]:
    """Per layer: (T_I, S_I|0, conv tail) for linear layers, 0-based K and V for full layers,
    over the interior [w, |C| - w). Requires |C| > 2w."""
    length = len(token_ids)
    if length <= 2 * seam_width:
        raise ValueError(f"a segment of {length} tokens has no interior at seam width {seam_width}")
    capture = InteriorCapture(seam_width, length - seam_width)
    empty = RequestState.empty(model.config, model.device, model.dtype)
    combine(model, list(token_ids), [Run(0, length)], empty, capture=capture, need_logits=False)
    return [capture.layers[i] for i in range(len(model.layers))]


def prefill_leading(model: HybridModel, token_ids: tuple[int, ...]) -> RequestState:
    """The running state after the leading segment at positions 0..|L|-1."""
    empty = RequestState.empty(model.config, model.device, model.dtype)
    return combine(model, list(token_ids), [Run(0, len(token_ids))], empty, need_logits=False).state
