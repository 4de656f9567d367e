"""Drivers of stepwise computations (``hypic.assembler.Steps``) that only tests need: several prefills
run together the way the engine loop batches them, and a document's interior prefilled in one go."""
from typing import Any

from hypic.assembler import CombineResult, CombineWork, Steps, combine_batch, drain
from hypic.cache.segments import Seams
from hypic.cache.store import InteriorLayer
from hypic.models import HybridModel
from hypic.segment_prefill import prefill_interior_steps


def drain_together(steps: list[Steps[Any]]) -> list[Any]:
    """Run several stepwise computations (of one model) to the end together: each round, the combine
    passes they ask for run in one ``combine_batch``; returns their results in order."""
    results: list[Any] = [None] * len(steps)
    replies: list[CombineResult | None] = [None] * len(steps)
    live = list(range(len(steps)))
    while live:
        works: dict[int, CombineWork] = {}
        for i in list(live):
            try:
                work = steps[i].send(replies[i])
            except StopIteration as done:
                results[i] = done.value
                live.remove(i)
                continue
            replies[i] = None
            if work is not None:
                works[i] = work
        if works:
            for i, result in zip(works, combine_batch(list(works.values()))):
                replies[i] = result
    return results


def prefill_interior(model: HybridModel, token_ids: tuple[int, ...], seams: Seams,
                     transitions: bool = True) -> list[InteriorLayer]:
    """``prefill_interior_steps`` in one go."""
    return drain(prefill_interior_steps(model, token_ids, seams, transitions=transitions))
