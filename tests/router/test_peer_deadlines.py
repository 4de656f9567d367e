"""Peers that stall or fail never stall the server: every wait on a worker ends by the worker
timeout (the worker is then lost: forgotten, killed, logged), a request whose peer work does not
finish in time runs here alone, the pool's lock is never held across a slow Ray operation (what
the engine loop calls on the pool returns while a transfer group is rebuilt or a worker killed),
and a peer build that fails is logged and counted, and not counted as built remotely.

Ray is replaced by an in-process stand-in (``hypic_testing.fake_ray``): its actors are real
``Worker``s or stubs, its ``get`` honours timeouts as Ray's does."""
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypic_testing.fake_ray import FakeRay, Stall

from hypic import DEFAULT_SEPARATOR, Engine, default_model_path
from hypic.router import PeerPrefill
from hypic.router import group as group_module
from hypic.router import peers as peers_module
from hypic.router import pool as pool_module
from hypic.router.group import Joined
from hypic.router.pool import WorkerPool
from hypic.router.worker import LoopStalled, Worker
from hypic.scheduler.loop import EngineLoop
from hypic.server.app import ServerInfo, build_app
from hypic.server.chat import load_chat_template

Prompt = Callable[[list[int], str], str]


class StubWorker:
    """A worker that answers at once and holds nothing (an attribute set on it replaces a method)."""

    def __init__(self, model: str, threads: int, options: dict[str, Any], timeout_s: float | None = None) -> None:
        self.options = options

    def fingerprint(self) -> str:
        return "stub"

    def held(self) -> list[str]:
        return []

    def build(self, jobs: list, mode: Any, priority: float = 0, ship_to: Any = None) -> list:
        return []

    def fetch(self, keys: list[str], ship_to: Any = None) -> list:
        return []


class FailingWorker(Worker):
    """A real worker whose every build raises."""

    def build(self, *args: Any, **kwargs: Any) -> list:
        raise RuntimeError("the build's disk is full")


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRay]:
    fake = FakeRay()
    monkeypatch.setattr(pool_module, "ray", fake)
    yield fake
    fake.close()


def _within(seconds: float, call: Callable[[], Any]) -> Any:
    """``call()``'s value (or error), which must come within ``seconds`` (a hang check)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _peers(pool: WorkerPool) -> PeerPrefill:
    """The server's peer prefill over ``pool`` (no Ray started)."""
    peers = PeerPrefill.__new__(PeerPrefill)
    peers._attach(pool)
    return peers


def test_a_worker_that_never_answers_a_sync_is_lost_within_the_timeout(fake_ray: FakeRay,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    fake_ray.make_actor = lambda cls, *args: StubWorker(*args)
    pool = WorkerPool("default", [1, 2], 1, {}, (0,), timeout_s=0.5, transfer="ray")
    stall = Stall()
    fake_ray.actors[0].held = stall  # worker 1
    try:
        with caplog.at_level(logging.WARNING, "hypic.router"):
            _within(10, lambda: pool.sync(1))
            _within(10, lambda: pool.flush("some-namespace"))  # re-reads what the rest hold: answers at once
    finally:
        stall.released.set()
    assert sorted(pool.workers) == [2] and pool.lost == [1] and fake_ray.killed == [fake_ray.actors[0]]
    assert "worker 1 lost (GetTimeoutError" in caplog.text and "killed" in caplog.text


def test_a_worker_call_waits_on_its_engine_loop_no_longer_than_the_timeout() -> None:
    """The worker's own waits (on its engine loop) end by the timeout too: the call fails, it does
    not hang; and the pool takes a worker whose loop is stuck as lost (forgotten, killed)."""
    worker = Worker("default", None, {}, timeout_s=0.3)
    try:
        worker.loop.call(lambda: time.sleep(3))  # the loop is busy for longer than the timeout
        with pytest.raises(LoopStalled):
            _within(10, worker.held)
    finally:
        worker.loop.stop()


def test_a_worker_whose_engine_loop_is_stuck_is_lost(fake_ray: FakeRay) -> None:
    fake_ray.make_actor = lambda cls, *args: StubWorker(*args)
    pool = WorkerPool("default", [1, 2], 1, {}, (0,), timeout_s=30, transfer="ray")

    def stalled() -> list[str]:
        raise LoopStalled("the worker's engine loop did not answer within 120 s")

    fake_ray.actors[1].held = stalled  # worker 2
    _within(10, lambda: pool.sync(2))
    assert sorted(pool.workers) == [1] and pool.lost == [2] and fake_ray.killed == [fake_ray.actors[1]]


def test_planning_and_dispatch_do_not_wait_on_a_group_rebuild_or_a_kill(
        fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch, pic_prompt: Prompt) -> None:
    """What the engine loop's thread calls on the pool (``PeerPrefill.plan``, ``PeerPrefill.dispatch``,
    from ``PeerRequest.start``) and the status the HTTP handlers read return within 1 s while another
    thread rebuilds the transfer group for 5 s, and while a lost worker's kill takes 5 s."""
    slow = threading.Event()

    def join(self: group_module.BulkGroup, rebuild: group_module.Rebuild) -> Joined:
        if slow.is_set():
            time.sleep(5)
        return Joined(None, None, {w: rank for rank, w in enumerate(rebuild.members)})

    monkeypatch.setattr(group_module.BulkGroup, "_join", join)
    fake_ray.make_actor = lambda cls, *args: StubWorker(*args)
    peers = _peers(WorkerPool("default", [1, 2, 3], 1, {}, (0,), timeout_s=30, transfer="torch"))
    engine = Engine.from_pretrained("default")
    request = engine.plan(engine.parse(pic_prompt([0, 1, 2, 3, 4, 5], "Who studied herons?")), "hypic")

    def loop_calls() -> None:
        plan = peers.plan(request, engine.cache.document_keys())
        peers.dispatch(plan, "hypic")
        peers.status()

    slow.set()
    peers.pool.forget(3)  # a loss: the group needs rebuilding
    rebuilding = threading.Thread(target=peers.pool.rebuild_group_if_needed)
    rebuilding.start()
    time.sleep(0.2)
    _within(1, loop_calls)
    rebuilding.join(30)
    assert peers.pool.group.live and peers.pool.group.generation == 2 and peers.pool.group.ranks == {0: 0, 1: 1, 2: 2}
    fake_ray.kill_delay_s = 5
    killing = threading.Thread(target=lambda: peers.pool.forget(2, kill=True))
    killing.start()
    time.sleep(0.2)
    _within(1, loop_calls)
    killing.join(30)
    assert sorted(peers.pool.workers) == [1] and peers.pool.lost == [3, 2]


def _server(peers: PeerPrefill) -> tuple[TestClient, EngineLoop]:
    """A server's app over its own engine loop (default model) and ``peers``."""
    template, from_model = load_chat_template(default_model_path())
    info = ServerInfo(str(default_model_path()), "default", "test", False, from_model, template, "hypic", 8,
                      DEFAULT_SEPARATOR, 256, 8, None, None, "cpu", "float32")
    loop = EngineLoop(Engine.from_pretrained("default"), "hypic")
    loop.start()
    return TestClient(build_app(loop, info, peers)), loop


def _generate(client: TestClient, prompt: str) -> dict:
    response = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert response.status_code == 200, response.text
    return response.json()


def test_peer_work_that_never_finishes_leaves_the_request_to_run_here(
        fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch, pic_prompt: Prompt, caplog: pytest.LogCaptureFixture) -> None:
    """The peers' shipments never come (a transfer stuck beyond the pool's waits): past the worker
    timeout (1 s) the request runs on the server alone, with one engine's answer, and counts as a
    failed peer prefill; what comes late is ignored and the server serves on."""
    peers = _peers(WorkerPool("default", [1], 1, {"seam_width": 8}, (0,), timeout_s=1.0, transfer="ray"))
    stuck = threading.Event()
    arrivals = peers.arrivals

    def stuck_arrivals(dispatch: Any, check: Any) -> Iterator:
        stuck.wait(120)
        yield from arrivals(dispatch, check)

    monkeypatch.setattr(peers, "arrivals", stuck_arrivals)
    client, loop = _server(peers)
    engine = Engine.from_pretrained("default")
    try:
        prompt = pic_prompt([0, 1, 2, 3], "Where was the heron born?")
        with caplog.at_level(logging.WARNING):
            served = _within(60, lambda: _generate(client, prompt))
        assert served["output_ids"] == engine.generate(prompt, max_new_tokens=8).output_ids
        assert client.get("/get_server_info").json()["workers"]["peer_prefill_failures"] == 1
        assert "PeerTimeout" in caplog.text
        stuck.set()  # the late shipments come in: ignored
        monkeypatch.setattr(peers, "arrivals", arrivals)
        again = pic_prompt([4, 5, 6], "Where was the ibis born?")
        assert _within(60, lambda: _generate(client, again))["output_ids"] == engine.generate(
            again, max_new_tokens=8).output_ids
    finally:
        stuck.set()
        loop.stop()
        peers.close()


def test_a_failed_peer_build_is_logged_counted_and_not_counted_as_built_remotely(
        fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch, pic_prompt: Prompt, caplog: pytest.LogCaptureFixture) -> None:
    """Two peers (real workers in this process); every build of peer 2 raises. The answer is one
    engine's; the failures are logged with the worker and cause and counted in /get_server_info and
    /metrics; the request's segments_built_remotely and remote_prefill_tokens are those of the
    entries the server actually installed from peer 1 (counted where they are installed), not the
    peers' planned documents."""
    fake_ray.make_actor = lambda cls, model, threads, options, timeout_s: (
        FailingWorker if len(fake_ray.actors) == 1 else cls)(model, None, options, timeout_s)
    peers = _peers(WorkerPool("default", [1, 2], 1, {"seam_width": 8}, (0,), timeout_s=60, transfer="ray"))
    plans, installed = [], []
    plan, install = peers.plan, peers_module.install_entries
    monkeypatch.setattr(peers, "plan", lambda *args, **kwargs: plans.append(plan(*args, **kwargs)) or plans[-1])

    def counted_install(*args: Any) -> tuple[list[str], int]:
        kept, refused = install(*args)
        installed.extend(kept)
        return kept, refused

    monkeypatch.setattr(peers_module, "install_entries", counted_install)
    client, loop = _server(peers)
    try:
        prompt = pic_prompt([0, 1, 2, 3, 4, 5, 6, 7, 8], "Who studied stoats?")
        with caplog.at_level(logging.WARNING, "hypic.router"):
            meta = _generate(client, prompt)["meta_info"]
        expected = Engine.from_pretrained("default").generate(prompt, max_new_tokens=8)
        (built,) = plans
        assert built.combine == 0 and built.builds.get(1) and built.builds.get(2)
        assert sorted(installed) == sorted(job.key for job in built.builds[1])  # peer 2 shipped nothing
        tokens = sum(job.tokens for job in built.builds[1] if job.key in installed)
        assert (meta["segments_built_remotely"], meta["remote_prefill_tokens"]) == (len(installed), tokens)
        assert (meta["segments_missed"], meta["cached_tokens"]) == (expected.segments_missed, expected.cached_tokens)
        info = client.get("/get_server_info").json()
        failures = len(built.builds[2])  # one build task per document
        assert info["workers"]["peer_build_failures"] == failures
        assert info["segments_built_remotely"] == len(installed)
        assert f"hypic_peer_build_failures_total {failures}" in client.get("/metrics").text
        assert caplog.text.count("worker 2: a build failed (RuntimeError: the build's disk is full)") == failures
    finally:
        loop.stop()
        peers.close()
