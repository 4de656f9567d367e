"""Workers that die: a lost builder's documents are recomputed on the combine node (same output);
a lost combine node fails only its request; the router keeps serving on the rest."""
import threading
from collections.abc import Callable, Iterator

import pytest
import ray
from ray.exceptions import RayActorError

from hypic import Engine
from hypic.router import Router, document_jobs

Prompt = Callable[[list[int], str], str]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("default")


@pytest.fixture
def router() -> Iterator[Router]:
    router = Router("default", workers=3, threads=1)
    yield router
    router.shutdown()
    ray.shutdown()


def _expected(engine: Engine, prompt: str) -> list[int]:
    return engine.generate(prompt, max_new_tokens=8, mode="hypic").output_ids


def test_a_builder_lost_before_dispatch_is_recomputed_elsewhere(router: Router, engine: Engine, pic_prompt: Prompt) -> None:
    ray.kill(router.workers[1])  # the router does not know yet
    prompt = pic_prompt([0, 1, 2, 3, 4, 5], "Where was the lynx born?")
    routed = router.generate(prompt, max_new_tokens=8)
    assert 1 in routed.plan.builds and routed.lost_workers == [1]
    assert routed.result.output_ids == _expected(engine, prompt)
    assert 1 not in router.workers and router.index.keys_of(1) == set()
    group = router.pool.group  # the gloo group did not survive the loss: rebuilt over the survivors
    assert group.live and group.generation == 2 and group.ranks == {0: 0, 2: 1}
    again = router.generate(pic_prompt([5, 4, 3, 2, 1, 0, 6, 7], "Who was born in 1914?"), max_new_tokens=8)
    assert set(again.plan.builds) | {again.plan.combine} <= {0, 2}
    assert again.result.output_ids == _expected(engine, pic_prompt([5, 4, 3, 2, 1, 0, 6, 7], "Who was born in 1914?"))
    builder = ({0, 2} - {again.plan.combine}).pop()
    counts = ray.get(router.workers[again.plan.combine].receive_counts.remote())
    assert again.plan.builds.get(builder) and counts.point_to_point >= len(again.plan.builds[builder])
    assert counts.failed == 0


def test_a_builder_killed_mid_dispatch(router: Router, engine: Engine, pic_prompt: Prompt, docs: list[str]) -> None:
    """Worker 2 is kept busy by a long job the router does not know of, so the request's documents
    on it are still queued when it is killed; worker 0 holds warm documents: it is the combine node."""
    router.warmup([docs[0], docs[1]], worker=0)
    long_docs = [" ".join(docs) + f" Copy {i}." for i in range(6)]
    long_job = document_jobs(router.planner.plan(router.planner.documents(long_docs)))
    busy = router.workers[2].build.remote(long_job, "hypic")
    threading.Timer(0.5, ray.kill, args=(router.workers[2],)).start()
    prompt = pic_prompt(list(range(10)), "What did the crane study?")
    routed = router.generate(prompt, max_new_tokens=8)
    assert routed.plan.combine == 0 and 2 in routed.plan.builds and routed.lost_workers == [2]
    assert routed.result.output_ids == _expected(engine, prompt)
    assert 2 not in router.workers
    with pytest.raises(RayActorError):
        ray.get(busy)


def test_a_worker_that_does_not_answer_in_time_is_lost(engine: Engine, pic_prompt: Prompt, docs: list[str]) -> None:
    """Worker 1 is stuck in a long job: after ``timeout_s`` it is declared lost and killed, and its
    documents are recomputed on the combine node (whose answer has the same deadline: 3 s leave
    room for that recompute on a loaded box)."""
    router = Router("default", workers=2, threads=1, timeout_s=3.0)
    try:
        router.warmup([docs[0], docs[1]], worker=0)
        for batch in range(8):  # eight long jobs: far longer than timeout_s on any box
            long_docs = [" ".join(docs) + f" Copy {batch}.{i}." for i in range(8)]
            router.workers[1].build.remote(document_jobs(router.planner.plan(router.planner.documents(long_docs))), "hypic")
        prompt = pic_prompt(list(range(6)), "Who was born in 1928?")
        routed = router.generate(prompt, max_new_tokens=8)
        assert routed.plan.combine == 0 and 1 in routed.plan.builds and routed.lost_workers == [1]
        assert routed.dispatch_s < 10 and routed.result.output_ids == _expected(engine, prompt)
        assert list(router.workers) == [0]
    finally:
        router.shutdown()
        ray.shutdown()


def test_a_lost_combine_node_fails_only_its_request(router: Router, engine: Engine, pic_prompt: Prompt, docs: list[str]) -> None:
    router.warmup([docs[7], docs[8]], worker=0)
    ray.kill(router.workers[0])
    with pytest.raises(RayActorError):
        router.generate(pic_prompt([7, 8, 9], "Where was the vole born?"), max_new_tokens=8)
    assert 0 not in router.workers
    prompt = pic_prompt([7, 8, 9], "Where was the vole born?")
    routed = router.generate(prompt, max_new_tokens=8)
    assert routed.plan.combine in {1, 2} and routed.result.output_ids == _expected(engine, prompt)


def test_a_combine_node_lost_while_it_decodes_is_forgotten(router: Router, engine: Engine, pic_prompt: Prompt,
                                                          docs: list[str]) -> None:
    """The combine node holds every document (nothing to build or ship) and dies during its long
    decode: the request fails with the loss, the router forgets the node, the next request runs
    on the others."""
    router.warmup([docs[7], docs[8], docs[9]], worker=0)
    prompt = pic_prompt([7, 8, 9], "Where was the vole born?")
    killer = threading.Timer(1.5, ray.kill, args=(router.workers[0],))
    killer.start()
    with pytest.raises(RayActorError):
        router.generate(prompt, max_new_tokens=7_000, ignore_eos=True)  # ~30 s of decoding
    killer.join()
    assert 0 not in router.workers
    routed = router.generate(prompt, max_new_tokens=8)
    assert routed.plan.combine in {1, 2} and routed.result.output_ids == _expected(engine, prompt)


def test_a_lost_peer_of_the_server_costs_only_its_documents(engine: Engine, pic_prompt: Prompt) -> None:
    """The server's peer prefill (``hypic serve --workers 3``): a peer dies before shipping; the
    server stores what the other peer shipped, its own prefill recomputes the rest, and the
    status reports the loss."""
    from hypic.router import PeerPrefill
    from hypic.router.transfer import entry_check, install_entries

    peers = PeerPrefill("default", 3, threads=1)
    try:
        local = Engine.from_pretrained("default")
        prompt = pic_prompt(list(range(9)), "Where was the ibis born?")
        plan = peers.plan(local.plan(local.parse(prompt)), local.cache.document_keys())
        assert set(plan.builds) == {0, 1, 2} and plan.combine == 0
        ray.kill(peers.pool.workers[1])
        check = entry_check(local.fingerprint, local.policy("hypic").role, local.model.config)
        entries = [entry for batch, _ in peers.arrivals(peers.dispatch(plan, "hypic"), check) for entry in batch]
        assert {e.key for e in entries} == {job.key for job in plan.builds[2]}
        assert install_entries(local, entries, "hypic")[0] == [e.key for e in entries]
        assert peers.status()["workers"] == [0, 2] and peers.status()["lost_workers"] == [1]
        result = local.generate(prompt, max_new_tokens=8)
        assert result.output_ids == _expected(engine, prompt)
        assert result.segments_hit == len(plan.builds[2])
    finally:
        peers.shutdown()
        ray.shutdown()
