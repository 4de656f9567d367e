"""A ``--workers 2`` request is parsed and planned once, where it arrives (the server), and that
plan is what the peer works from: every process counts its ``Planner.parse`` and ``Planner.plan``
calls into one log (a Ray setup hook patches them in the worker too). A logprob request's plan
keeps its ``logits_from``: peers build only the documents it splices. Peer threads never wait on
the loop: they post to its queue."""
import os
import sys
import threading
from concurrent.futures import Future
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import ray
from fastapi.testclient import TestClient

from hypic import DEFAULT_SEPARATOR, Engine, default_model_path
from hypic.cli import _parser, peer_engine_options
from hypic.planner import Planner
from hypic.router import PeerPrefill, document_jobs
from hypic.scheduler.loop import EngineLoop
from hypic.server.app import ServerInfo, build_app
from hypic.server.chat import load_chat_template

Prompt = Callable[[list[int], str], str]
LOG = "HYPIC_PLAN_LOG"


def count_plans() -> None:
    """In this process: each ``Planner.parse`` and ``Planner.plan`` call appends "pid name" to the
    file named by $HYPIC_PLAN_LOG (run in every Ray worker as it starts)."""
    import os

    from hypic.planner import Planner

    def counted(name: str, original: Callable) -> Callable:
        def call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            with open(os.environ["HYPIC_PLAN_LOG"], "a") as log:
                log.write(f"{os.getpid()} {name}\n")
            return original(self, *args, **kwargs)
        return call

    for name in ("parse", "plan"):
        setattr(Planner, name, counted(name, getattr(Planner, name)))


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, PeerPrefill, EngineLoop, Path]]:
    """``hypic serve --workers 2`` in this process, every process counting its plans into one log."""
    log = tmp_path / "plans.log"
    monkeypatch.setenv(LOG, str(log))
    for name in ("parse", "plan"):
        monkeypatch.setattr(Planner, name, getattr(Planner, name))  # put back after the test
    count_plans()
    # by value: the workers cannot import this test module (``tests`` is no package on their path)
    ray.cloudpickle.register_pickle_by_value(sys.modules[count_plans.__module__])
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": count_plans, "env_vars": {LOG: str(log)}})
    args = _parser().parse_args(["serve", "--workers", "2", "--threads", "1"])
    template, from_model = load_chat_template(default_model_path())
    info = ServerInfo(str(default_model_path()), "default", "test", False, from_model, template, "hypic", 8,
                      DEFAULT_SEPARATOR, 256, 8, args.public_pool_size, args.private_pool_size, "cpu", "float32")
    peers = PeerPrefill("default", 2, threads=1, engine_options=peer_engine_options(args))
    loop = EngineLoop(Engine.from_pretrained("default", private_pool_bytes=args.private_pool_size,
                                             chunk_tokens=args.chunked_prefill_size), "hypic")
    loop.start()
    waits = _watch(loop)
    try:
        yield TestClient(build_app(loop, info, peers)), peers, loop, log
        assert waits == []  # a peer thread waited on the loop's work
    finally:
        loop.stop()
        peers.shutdown()
        ray.shutdown()


def _watch(loop: EngineLoop) -> list[str]:
    """The loop's futures (of ``call``, ``build``, ``precombine``, ``run_steps``) note the name of any
    peer thread that waits on one; returns those names as they come."""
    waits: list[str] = []

    class Watched(Future):
        def result(self, timeout: float | None = None) -> object:
            if threading.current_thread().name.startswith("hypic-peer"):
                waits.append(threading.current_thread().name)
            return super().result(timeout)

    def watched(method: Callable[..., Future]) -> Callable[..., Future]:
        def call(*args: object, **kwargs: object) -> Future:
            inner, outer = method(*args, **kwargs), Watched()
            inner.add_done_callback(lambda done: outer.set_exception(done.exception()) if done.exception()
                                    else outer.set_result(done.result()))
            return outer
        return call

    for name in ("call", "build", "precombine", "run_steps"):
        setattr(loop, name, watched(getattr(loop, name)))
    return waits


def _calls(log: Path) -> Counter[tuple[int, str]]:
    """(pid, parse | plan) -> calls since the log was last emptied."""
    return Counter((int(pid), name) for pid, name in (line.split() for line in log.read_text().splitlines()))


def _generate(client: TestClient, prompt: str, **fields: object) -> dict:
    response = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                                              **fields})
    assert response.status_code == 200, response.text
    return response.json()


def _expected(prompt: str, warm: list[str], engine: Engine | None = None) -> list[int]:
    """One engine's output once it holds ``warm``."""
    engine = engine or Engine.from_pretrained("default")
    engine.warmup(warm)
    return engine.generate(prompt, max_new_tokens=4).output_ids


def test_a_request_combined_on_the_peer_is_planned_once(served, pic_prompt: Prompt, docs: list[str]) -> None:
    client, peers, loop, log = served
    planner = loop.engine.planner
    ray.get(peers.pool.workers[1].build.remote(document_jobs(planner.plan(planner.documents(docs[:4]))), "hypic"))
    peers.pool.sync(1)
    log.write_text("")
    prompt = pic_prompt([2, 0, 3, 1, 4], "Who studied lynxes?")
    result = _generate(client, prompt)
    assert result["meta_info"]["combined_early_tokens"] > 0  # the peer combined (and combined early) from the plan
    assert _calls(log) == {(os.getpid(), "parse"): 1, (os.getpid(), "plan"): 1}
    assert result["output_ids"] == _expected(prompt, docs[:4])


def test_a_request_combined_here_is_planned_once(served, pic_prompt: Prompt, docs: list[str]) -> None:
    """The server builds its share, combines the head it then holds while the peer's documents are
    on their way, and resumes there: one engine doing the same gives the same output."""
    client, peers, loop, log = served
    prompt = pic_prompt([5, 6, 7, 8], "Where was the vole born?")
    parts = loop.engine.parse(prompt)
    plan = peers.plan(loop.engine.plan(parts), set())
    here = [list(parts.segments).index(job.token_ids) for job in plan.builds[0]]
    log.write_text("")
    result = _generate(client, prompt)
    assert result["meta_info"]["segments_built_remotely"] > 0  # the peer built some of them
    assert _calls(log) == {(os.getpid(), "parse"): 1, (os.getpid(), "plan"): 1}
    engine = Engine.from_pretrained("default")
    engine.warmup([docs[5 + i] for i in here])
    engine.precombine(parts)
    assert result["output_ids"] == _expected(prompt, docs[5:9], engine)


def test_peers_build_only_what_a_logprob_request_splices(served, pic_prompt: Prompt, docs: list[str]) -> None:
    """Input logprobs from the third document on: only the first two documents are spliced, so only
    they are built, here or on the peer."""
    client, peers, loop, _ = served
    prompt = pic_prompt([0, 1, 2, 3], "Who had a loud call?")
    parts = loop.engine.parse(prompt)
    start = parts.segment_starts[2]
    result = _generate(client, prompt, return_logprob=True, logprob_start_len=start)
    keys = {i: key for i, key, _ in loop.engine.plan(parts).documents()}  # every document's key, unsliced
    built = set(loop.engine.cache.document_keys()) | set(ray.get(peers.pool.workers[1].held.remote()))
    assert built == {keys[0], keys[1]}
    alone = Engine.from_pretrained("default")
    expected = alone.prefill(parts, logits_from=start)
    assert len(result["meta_info"]["input_token_logprobs"]) == len(parts.token_ids) - start
    assert result["output_ids"][0] == int(expected.logits.argmax())
