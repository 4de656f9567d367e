"""A cache hit's host work: what an all-hit combine pass and a decode step dispatch, counted with
``hypic.evaluation.ops.OpCounter`` (deterministic: nothing here is timed).

- No op in them would sync a GPU with the host (a value read back, an output shaped by values, a
  copy to the host), for every linear family: a CUDA pass would not stall, and could be captured.
- The ops a prefill dispatches grow by at most 30 per extra cached document, and stay within 2,500
  at 16 documents on the 4-layer test model (the per-document work is batched, not looped).
"""
import random
from pathlib import Path
from typing import Callable

import pytest

import hypic.assembler as assembler
from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.evaluation.ops import OpCounter
from hypic_testing.tiny_models import FAMILY_CHECKPOINTS

WORDS = "alpha beta gamma delta river stone cloud paper lamp green blue quiet north south city field".split()


def _documents(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"\n\nDoc {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def _prompt(documents: list[str], seed: int) -> str:
    order = list(documents)
    random.Random(seed).shuffle(order)
    return SEP.join(["Answer from these.", *order, "\n\nQuestion: which comes first?"])


def _counted_prefill(engine: Engine, text: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The prefill of ``text`` counted as a whole, and each of its combine passes on its own."""
    combine, passes = assembler.combine_batch, []

    def counted(works: list) -> list:
        with OpCounter() as inner:
            out = combine(works)
        passes.append(inner)
        return out

    monkeypatch.setattr(assembler, "combine_batch", counted)
    with OpCounter() as whole:
        prefill = engine.prefill(engine.parse(text))
    monkeypatch.setattr(assembler, "combine_batch", combine)
    return prefill, whole, passes


@pytest.mark.parametrize("name", [*FAMILY_CHECKPOINTS, "gpt_oss", "mimo_v2_flash", "qwen3_next-moe"])
def test_an_all_hit_pass_and_a_decode_step_never_sync(checkpoint_factory: Callable[..., Path], name: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear family, sliding windows with sinks (gpt-oss, MiMo) and routed experts."""
    documents = _documents(6, 40)
    engine = Engine.from_pretrained(checkpoint_factory(name))
    engine.warmup(documents)
    prefill, _, passes = _counted_prefill(engine, _prompt(documents, 1), monkeypatch)
    assert prefill.stats.segments_hit == 6 and passes
    assert [dict(p.syncs) for p in passes] == [{}] * len(passes)
    token = int(prefill.logits.argmax())
    with OpCounter() as step:
        engine.runner.decode([prefill.state], [token])
    assert step.total > 0 and dict(step.syncs) == {}


def test_a_prefill_s_ops_barely_grow_with_its_cached_documents(checkpoint_factory: Callable[..., Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Documents of ~900 tokens on the 4-layer model (3 Gated DeltaNet layers, 1 attention layer):
    the all-hit prefill at 8 and 16 documents."""
    engine = Engine.from_pretrained(checkpoint_factory("qwen3_5_text-long-context"), public_pool_bytes=1 << 30,
                                    private_pool_bytes=1 << 30)
    documents = _documents(16, 170)
    counts = {}
    for count in (8, 16):
        engine.flush()
        engine.warmup(documents[:count])
        prefill, whole, passes = _counted_prefill(engine, _prompt(documents[:count], count), monkeypatch)
        assert prefill.stats.segments_hit == count and not any(p.syncs for p in passes)
        counts[count] = whole.total
    assert (counts[16] - counts[8]) / 8 <= 30, counts
    assert counts[16] <= 2500, counts
