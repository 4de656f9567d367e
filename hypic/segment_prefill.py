"""Cache-time prefill: a PIC segment alone from position 0, keeping only its interior."""
from .assembler import InteriorCapture, Steps, combine_chunked
from .models import HybridModel
from .models.families import empty_state
from .cache.segments import Run, Seams
from .cache.store import InteriorLayer

UNCHUNKED = 1 << 62


def prefill_interior_steps(model: HybridModel, token_ids: tuple[int, ...], seams: Seams,
                           chunk_tokens: int = UNCHUNKED, transitions: bool = True
                           ) -> Steps[list[InteriorLayer]]:
    """Per layer: (T_I, S_I|0, conv tail) for linear layers (no T_I unless ``transitions``), 0-based K
    and V for full layers, over the interior of ``seams``. Runs in chunks of ``chunk_tokens``, each
    asked for as a ``CombineWork``."""
    interior = seams.interior(len(token_ids))
    if interior is None:
        raise ValueError(f"a segment of {len(token_ids)} tokens has no interior with {seams}")
    capture = InteriorCapture(*interior, transitions=transitions)
    empty = empty_state(model.config, model.device, model.dtype)
    # the tail seam is recomputed at splice time: the prefill stops where the interior ends
    yield from combine_chunked(model, list(token_ids), [Run(0, interior[1])], empty, chunk_tokens=chunk_tokens,
                               capture=capture, need_logits=False)
    return [capture.layers[i] for i in range(len(model.layers))]
