"""Chunked prefill (what lets the serving loop decode between prefill chunks) against one pass."""
import random
from pathlib import Path

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.segment_prefill import prefill_interior_steps
from hypic_testing.steps import prefill_interior
from hypic.assembler import combine_batch, drain
from hypic.cache.segments import Run, Splice, chunk_pieces
from hypic.cache.store import AttentionInterior, LinearInterior


def test_chunk_pieces_cuts_runs_and_keeps_splices_before_runs() -> None:
    pieces = [Run(0, 10), Splice(0, 10, 50), Run(60, 3), Run(63, 8)]
    groups = chunk_pieces(pieces, 4)
    assert groups == [[Run(0, 4)], [Run(4, 4)], [Run(8, 2), Splice(0, 10, 50), Run(60, 2)], [Run(62, 1), Run(63, 3)],
                      [Run(66, 4)], [Run(70, 1)]]
    assert all(isinstance(g[-1], Run) and sum(p.length for p in g if isinstance(p, Run)) <= 4 for g in groups)
    with pytest.raises(ValueError):
        chunk_pieces(pieces, 0)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=7)


@pytest.mark.parametrize("chunk", [1, 5, 16, 33])
def test_chunked_interior_equals_one_pass(engine: Engine, chunk: int) -> None:
    ids = tuple(random.Random(chunk).randrange(256) for _ in range(41))
    whole = prefill_interior(engine.model, ids, engine.seams)
    chunked = drain(prefill_interior_steps(engine.model, ids, engine.seams, chunk))
    for a, b in zip(whole, chunked):
        if isinstance(a, LinearInterior):
            assert isinstance(b, LinearInterior)
            assert torch.allclose(a.transition.value, b.transition.value, atol=1e-5)
            assert torch.allclose(a.zero_start_state, b.zero_start_state, atol=1e-5)
            assert torch.allclose(a.conv_tail, b.conv_tail, atol=1e-5)
        else:
            assert isinstance(a, AttentionInterior) and isinstance(b, AttentionInterior)
            assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


@pytest.mark.parametrize("mode", ["full", "hypic"])
def test_chunked_request_prefill_equals_unchunked(engine: Engine, tiny_checkpoint: Path, mode: str) -> None:
    rng = random.Random(3)
    prompt = SEP.join(["".join(rng.choice("abcdefgh ") for _ in range(n)) for n in (9, 40, 33, 12)])
    unchunked = Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=10_000)
    steps = engine.prefiller.prefill_steps(engine.plan(engine.parse(prompt), mode))
    count, reply = 0, None
    while True:
        try:
            work = steps.send(reply)
        except StopIteration as done:
            chunked = done.value
            break
        count += work is not None
        reply = None if work is None else combine_batch([work])[0]
    reference = unchunked.prefill(unchunked.parse(prompt), mode)
    assert count >= 94 // 7 - 1 if mode == "full" else count >= 2  # it really ran in pieces
    assert (chunked.logits - reference.logits).abs().max().item() < 1e-4
    for ours, ref in zip(chunked.state.layers, reference.state.layers):
        for x, y in zip(ours.tensors(), ref.tensors()):
            assert torch.allclose(x, y, atol=1e-4)
