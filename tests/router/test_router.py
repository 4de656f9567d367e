"""Two Ray workers produce the single engine's greedy output for cold, partly warm (on either
worker), reordered and evicted documents (the single engine is itself checked against the
independent reference in tests/hypic/test_fidelity.py)."""
import random
import time
from collections.abc import Callable, Iterator

import pytest
import ray

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.router import Router
from hypic.router.plan import SegmentJob, document_jobs

Prompt = Callable[[list[int], str], str]

@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("default")


@pytest.fixture(scope="module")
def router(engine: Engine, docs: list[str]) -> Iterator[Router]:
    """Each worker's public pool holds five entries: requests of five documents evict earlier ones."""
    entry = engine.segment_entry(tuple(engine.tokenizer.encode(docs[0])), engine.policy("hypic"))[0]
    router = Router("default", workers=2, threads=1, engine_options={"public_pool_bytes": 5 * entry.nbytes + 1000})
    yield router
    router.shutdown()
    ray.shutdown()


def _same_as_engine(router: Router, engine: Engine, prompt: str):
    routed = router.generate(prompt, max_new_tokens=8)
    expected = engine.generate(prompt, max_new_tokens=8, mode="hypic")
    assert routed.result.output_ids == expected.output_ids
    return routed


def _received(router: Router, worker: int) -> tuple[int, int, int]:
    counts = ray.get(router.workers[worker].receive_counts.remote())
    return counts.point_to_point, counts.object_store, counts.failed


def test_cold_documents_are_spread_by_lpt(router: Router, engine: Engine, pic_prompt: Prompt) -> None:
    routed = _same_as_engine(router, engine, pic_prompt([0, 1, 2, 3], "Where was the otter born?"))
    assert set(routed.plan.builds) == {0, 1}
    assert sum(len(jobs) for jobs in routed.plan.builds.values()) == 4
    shipped = sum(len(jobs) for worker, jobs in routed.plan.builds.items() if worker != routed.plan.combine)
    assert shipped and _received(router, routed.plan.combine) == (shipped, 0, 0)  # over torch.distributed
    stats = routed.result.stats  # every document was built for the request: a miss wherever it was built
    assert (stats.segments_hit, stats.segments_missed, stats.segments_built_remotely) == (0, 4, shipped)


def test_documents_warm_on_either_worker_are_pulled(router: Router, engine: Engine, pic_prompt: Prompt, docs: list[str]) -> None:
    router.warmup([docs[4]], worker=0)
    router.warmup([docs[5], docs[6]], worker=1)
    routed = _same_as_engine(router, engine, pic_prompt([4, 5, 6, 7], "What did the stoat study?"))
    assert routed.plan.combine == 1  # it holds two of the three warm documents
    assert routed.plan.pulls == {0: [document_jobs(router.planner.plan(router.planner.parse(pic_prompt([4], ""))))[0].key]}


def test_reordered_documents_hit_everywhere(router: Router, engine: Engine, pic_prompt: Prompt) -> None:
    _same_as_engine(router, engine, pic_prompt([6, 5, 4], "Who had a red coat?"))
    routed = _same_as_engine(router, engine, pic_prompt([5, 6, 4], "Who had a red coat?"))
    assert routed.plan.builds == {} and routed.result.segments_missed == 0


def test_eviction_never_splices_a_wrong_entry(router: Router, engine: Engine, pic_prompt: Prompt, docs: list[str]) -> None:
    """Pools of five entries under prompts of five documents: the index goes stale between
    syncs, a pulled entry may be gone (the combine node rebuilds it); outputs stay exact."""
    rng = random.Random(5)
    for request in range(6):
        indices = rng.sample(range(len(docs)), 5)  # with the combine node's own: more than five
        _same_as_engine(router, engine, pic_prompt(indices, f"Question {request}: where was the heron born?"))
    assert router.pool.queued == {0: 0, 1: 0}  # every request released what it queued
    for worker in router.workers:  # every insert is followed by a sync: the index is exact
        assert router.index.keys_of(worker) == set(ray.get(router.workers[worker].held.remote()))


def test_a_worker_builds_for_the_request_with_fewer_uncached_tokens_first(router: Router, docs: list[str]) -> None:
    """Worker 1 is busy with a request that goes first (priority 0); a request needing 3000 tokens queues
    before one needing 100: the second's document is built first."""
    def jobs(texts: list[str]) -> list[SegmentJob]:
        return document_jobs(router.planner.plan(router.planner.documents(texts)))

    worker = router.workers[1]
    # busy well past the two's arrival on any box (a job of three documents was done in 0.4 s on a fast one)
    busy = [worker.build.remote(jobs([" ".join(docs) + f" Busy {b}.{i}." for i in range(8)]), "hypic", 0)
            for b in range(2)]
    time.sleep(0.3)
    large = worker.build.remote(jobs([" ".join(docs) + " Large."]), "hypic", 3000)
    time.sleep(0.1)
    small = worker.build.remote(jobs([docs[9] + " Small."]), "hypic", 100)
    first, _ = ray.wait([large, small], num_returns=1)
    assert first == [small]
    ray.get([*busy, large])


def test_a_plain_prompt_returns_to_the_worker_holding_its_prefix(router: Router, engine: Engine, docs: list[str]) -> None:
    """A chat-like prompt without documents first lands on worker 1 (worker 0 looks busy); its next
    turn, with equal loads, follows its prefix there and resumes it from that worker's private pool."""
    first = " ".join(docs[:3]) + "\nQuestion: who was born in 1907?\nAnswer:"
    router.pool.queued[0] += 10_000
    try:
        routed = router.generate(first, max_new_tokens=8)
    finally:
        router.pool.queued[0] -= 10_000
    assert routed.plan.combine == 1
    follow_up = first + engine.tokenizer.decode(routed.result.output_ids) + "\nQuestion: and in 1914?\nAnswer:"
    routed = _same_as_engine(router, engine, follow_up)
    assert routed.plan.combine == 1
    assert routed.result.cached_tokens >= len(engine.tokenizer.encode(first)) - 1  # the first turn's prompt


def test_the_combine_node_combines_its_held_head_while_a_peer_builds(router: Router, engine: Engine,
                                                                     docs: list[str]) -> None:
    """Worker 0 holds the first two documents; the third is cold and goes to worker 1, kept busy
    first: worker 0 combines the two-document head before the third arrives, and the request
    resumes at that head's end with the single engine's output and statistics."""
    held, cold = [docs[7] + " Early.", docs[8] + " Early."], docs[9] + " Late."
    router.warmup(held, worker=0)
    busy_job = document_jobs(router.planner.plan(router.planner.documents([" ".join(docs * 3) + " Busy."])))[0]
    busy = router.workers[1].build.remote([busy_job], "hypic", 0)
    lead = "Answer early from these records."  # no earlier request began so: nothing of it is cached
    prompt = DEFAULT_SEPARATOR.join([lead, *held, cold, "Question: who was born in 1963?\nAnswer:"])
    routed = _same_as_engine(router, engine, prompt)
    ray.get(busy)
    router.pool.sync(1)
    parts = router.planner.parse(prompt)
    assert routed.plan.combine == 0 and list(routed.plan.builds) == [1]  # the combine pass counts as load on 0
    assert routed.combined_early == len(parts.leading) + len(parts.segments[0]) + len(parts.segments[1])
    alone = Engine.from_pretrained("default")  # holding what worker 0 held when the request came
    alone.warmup(held)
    expected = alone.generate(prompt, max_new_tokens=8).stats
    fields = ("cached_tokens", "prefix_hit_tokens", "segments_hit", "segments_missed", "combine_tokens")
    assert {f: getattr(routed.result.stats, f) for f in fields} == {f: getattr(expected, f) for f in fields}
