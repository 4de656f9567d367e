"""A peer path that breaks costs only speed: the request runs on the server's engine alone."""
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi.testclient import TestClient

from hypic import DEFAULT_SEPARATOR, Engine, default_model_path
from hypic.server.app import ServerInfo, build_app
from hypic.server.chat import load_chat_template
from hypic.scheduler.loop import EngineLoop


class BrokenPeers:
    """Peers whose every call fails (e.g. the Ray cluster went away)."""

    def __init__(self) -> None:
        self.closed = False

    def prefill_for(self, loop: EngineLoop, request: Any) -> Future:
        failed: Future = Future()
        failed.set_exception(ConnectionError("the Ray cluster is unreachable"))
        return failed

    def warmup_for(self, loop: EngineLoop, documents: list[str], namespace: str = "") -> Future:
        raise AssertionError("a bad warm-up must be refused before the peers see it")

    def status(self) -> dict[str, Any]:
        return {"workers": [0], "lost_workers": [1]}

    def close(self) -> None:
        self.closed = True


def _started_loop() -> tuple[EngineLoop, ServerInfo]:
    """A running engine loop on the default model and the server info that describes it."""
    template, from_model = load_chat_template(default_model_path())
    info = ServerInfo(str(default_model_path()), "default", "test", False, from_model, template, "hypic", 8,
                      DEFAULT_SEPARATOR, 256, 8, None, None, "cpu", "float32")
    loop = EngineLoop(Engine.from_pretrained("default"), "hypic")
    loop.start()
    return loop, info


def test_a_broken_peer_path_falls_back_to_the_local_engine(pic_prompt: Callable[[list[int], str], str]) -> None:
    loop, info = _started_loop()
    try:
        client = TestClient(build_app(loop, info, BrokenPeers()))
        prompt = pic_prompt([0, 1, 2], "Where was the badger born?")
        response = client.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert response.status_code == 200
        expected = Engine.from_pretrained("default").generate(prompt, max_new_tokens=8)
        assert response.json()["output_ids"] == expected.output_ids
        assert client.get("/get_server_info").json()["workers"]["peer_prefill_failures"] == 1
    finally:
        loop.stop()


def test_bad_warmup_is_refused_before_planning_and_shutdown_stops_peer_waits() -> None:
    """A document holding the separator is refused before the peers plan anything; the app's shutdown
    closes the peers' waits (nothing more can be queued there)."""
    loop, info = _started_loop()
    peers = BrokenPeers()
    app = build_app(loop, info, peers)
    try:
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
            refused = client.post("/warmup", json={"documents": [f"one {DEFAULT_SEPARATOR} two"]})
            assert refused.status_code == 400 and "PIC separator" in refused.json()["error"]["message"]
            assert not peers.closed
    finally:
        loop.stop()
    assert peers.closed
