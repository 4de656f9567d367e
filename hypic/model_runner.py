"""What every rank executes: the model's passes over the slots it is handed, and nothing it decides.

A prefill is written as ``Steps`` (``assembler``): a generator that asks for combine passes. The
runner makes the two kinds of step a request needs (a document's entry built alone, and the
combine pass of a laid-out prompt) and runs passes: several requests' passes as one batch
(``run``), a decode step over many requests' states (``decode``). Which requests run, what they
reuse and what is kept is decided elsewhere (the scheduler, ``HybridCache``); under tensor
parallelism every rank runs the same passes on its shard of the model and of the states.
"""
import torch

from .assembler import CombineResult, CombineWork, Steps, combine_batch, combine_chunked
from .cache.modes import ModePolicy
from .cache.segments import Piece
from .cache.store import LinearInterior, SegmentEntry
from .decode import decode_batch
from .models import HybridModel
from .models.families import empty_state
from .segment_prefill import prefill_interior_steps
from .state import RequestState


class ModelRunner:
    """``model``'s passes: prefills in chunks of at most ``chunk_tokens`` recomputed tokens (a serving
    loop decodes between two), documents' entries stored with ``T_C`` and ``S_C|0`` in
    ``state_cache_dtype``."""

    def __init__(self, model: HybridModel, chunk_tokens: int, state_cache_dtype: torch.dtype) -> None:
        self.model, self.chunk_tokens, self.state_cache_dtype = model, chunk_tokens, state_cache_dtype

    def empty_state(self) -> RequestState:
        """A state of no tokens on the model's device (what a prefill from scratch starts from)."""
        return empty_state(self.model.config, self.model.device, self.model.dtype)

    def entry_steps(self, key: str, token_ids: tuple[int, ...], policy: ModePolicy) -> Steps[SegmentEntry]:
        """Prefill a document alone and return its entry under ``key``: the interior of ``policy``'s
        seams, stored as the public pool keeps it (not offered to the pool: the caller decides)."""
        assert policy.seams is not None
        layers = yield from prefill_interior_steps(self.model, token_ids, policy.seams, self.chunk_tokens,
                                                   policy.transitions)
        lo, hi = policy.seams.interior(len(token_ids)) or (0, 0)
        # under tensor parallelism each rank's shard has its own decayed heads, but the ranks' pools must
        # take the same bytes for an entry to decide alike: the shards keep every matrix
        flag = not self.model.config.tensor_parallel.enabled
        layers = [layer.stored_as(self.state_cache_dtype, flag) if isinstance(layer, LinearInterior) else layer
                  for layer in layers]
        return SegmentEntry(key, token_ids, policy.seams, lo, hi - lo, layers, policy.namespace)

    def combine_steps(self, token_ids: list[int], pieces: list[Piece], init: RequestState,
                      entries: dict[int, SegmentEntry], policy: ModePolicy, snapshot_at: list[int],
                      logits_from: int | None) -> Steps[CombineResult]:
        """The combine pass of a laid-out prompt (``pieces`` from ``init.length``, spliced ``entries``)
        in chunks; its states at ``snapshot_at`` are recorded, and with ``logits_from`` the logits of
        every position from there on."""
        return combine_chunked(self.model, token_ids, pieces, init, entries, chunk_tokens=self.chunk_tokens,
                               naive=not policy.transitions, snapshot_at=snapshot_at, logits_from=logits_from)

    def run(self, works: list[CombineWork]) -> list[CombineResult]:
        """Several requests' combine passes in one pass through the model (each result equals its
        pass run alone)."""
        return combine_batch(works)

    def decode(self, states: list[RequestState], tokens: list[int]) -> tuple[torch.Tensor, list[RequestState]]:
        """Append ``tokens[b]`` to ``states[b]`` in place; returns logits [B, vocab] and the states."""
        return decode_batch(self.model, states, tokens)

