"""Two Ray workers on a sliding-window hybrid (MiMo-V2-Flash-shaped): entries whose sliding layers
hold their last W tokens cross over gloo, and the output equals one engine's, in order and reordered."""
import random
from collections.abc import Callable
from pathlib import Path

import ray

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.router import Router


def test_two_workers_answer_as_one_engine(checkpoint_factory: Callable[..., Path]) -> None:
    path = checkpoint_factory("mimo_v2_flash")
    rng = random.Random(0)
    docs = ["".join(rng.choice("abcdefgh ") for _ in range(n)) for n in (90, 120, 70, 100)]
    engine = Engine.from_pretrained(path)
    engine.warmup(docs)
    router = Router(str(path), workers=2, threads=1)
    try:
        for order, (hit, missed) in (([0, 1, 2, 3], (0, 4)), ([3, 1, 0, 2], (4, 0))):  # cold, then all held
            prompt = SEP.join(["lead", *(docs[i] for i in order), "q?"])
            routed = router.generate(prompt, max_new_tokens=8)
            assert routed.result.output_ids == engine.generate(prompt, max_new_tokens=8).output_ids
            assert (routed.result.segments_hit, routed.result.segments_missed) == (hit, missed)
        counts = ray.get(router.workers[routed.plan.combine].receive_counts.remote())
        assert counts.point_to_point >= 1 and counts.object_store == counts.failed == 0
    finally:
        router.shutdown()
        ray.shutdown()
