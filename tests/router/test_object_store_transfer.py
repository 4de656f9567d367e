"""``transfer="ray"``: entries through Ray's object store instead of torch.distributed give the same
output (its own module: the Ray runtime of tests/router/test_router.py has no CPUs to spare)."""
from collections.abc import Callable

import ray

from hypic import Engine
from hypic.router import Router

Prompt = Callable[[list[int], str], str]


def test_the_object_store_transfer_gives_the_same_output(pic_prompt: Prompt) -> None:
    engine = Engine.from_pretrained("default")
    prompt = pic_prompt([0, 1, 2, 3], "Where was the otter born?")
    router = Router("default", workers=2, threads=1, transfer="ray")
    try:
        routed = router.generate(prompt, max_new_tokens=8)
        assert routed.result.output_ids == engine.generate(prompt, max_new_tokens=8, mode="hypic").output_ids
        shipped = sum(len(jobs) for worker, jobs in routed.plan.builds.items() if worker != routed.plan.combine)
        counts = ray.get(router.workers[routed.plan.combine].receive_counts.remote())
        assert shipped and (counts.point_to_point, counts.object_store, counts.failed) == (0, shipped, 0)
        assert router.pool.status()["transfer"] == "ray object store"
    finally:
        router.shutdown()
        ray.shutdown()
