"""Admission before peers: with --workers, a request whose state does not fit beside what is running
waits for room (QUEUED in the server's loop) before anything is planned, built or shipped for it on
the peers, and then runs as with one worker."""
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi.testclient import TestClient

from hypic import DEFAULT_SEPARATOR, Engine, default_model_path
from hypic.server.app import ServerInfo, build_app
from hypic.server.chat import load_chat_template
from hypic.scheduler.loop import EngineLoop

NEW_TOKENS = 48


class RecordingPeers:
    """Peers that note, when a request is planned on them (the first peer work for it), how many
    requests the server's loop was running; then fail, so the request runs on the server alone."""

    def __init__(self, loop: EngineLoop) -> None:
        self.loop, self.running_when_planned = loop, []

    def prefill_for(self, loop: EngineLoop, request: Any) -> Future:
        self.running_when_planned.append(self.loop.snapshot["running_requests"])
        failed: Future = Future()
        failed.set_exception(ConnectionError("no peers in this test"))
        return failed

    def status(self) -> dict[str, Any]:
        return {"workers": [0], "lost_workers": []}

    def close(self) -> None:
        pass


def _body(prompt: str) -> dict[str, Any]:
    return {"text": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}


def test_a_request_that_does_not_fit_yet_waits_before_its_peers_plan_anything(
        pic_prompt: Callable[[list[int], str], str]) -> None:
    """--max-state-memory holds one request, not two: the second is planned on the peers only once the
    first has finished (0 running then; 1 if peer work started at submission), and both answer as one engine would."""
    engine = Engine.from_pretrained("default", dtype="float32")
    first, second = pic_prompt([0, 1, 2], "Where was the badger born?"), pic_prompt([3, 4, 5], "Who won?")
    footprint = max(engine.state_bytes(len(engine.parse(p).token_ids) + NEW_TOKENS, 1) for p in (first, second))
    loop = EngineLoop(engine, "hypic", max_state_bytes=int(1.5 * footprint))
    loop.start()
    template, from_model = load_chat_template(default_model_path())
    info = ServerInfo(str(default_model_path()), "default", "test", False, from_model, template, "hypic", 8,
                      DEFAULT_SEPARATOR, 256, 8, None, None, "cpu", "float32")
    peers = RecordingPeers(loop)
    answers: dict[str, Any] = {}
    try:
        client = TestClient(build_app(loop, info, peers))
        runner = threading.Thread(target=lambda: answers.update(first=client.post("/generate", json=_body(first))))
        runner.start()
        deadline = time.monotonic() + 60
        while loop.snapshot["running_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert loop.snapshot["running_requests"] == 1, "the first request never started decoding"
        answers["second"] = client.post("/generate", json=_body(second))
        runner.join()
    finally:
        loop.stop()
    assert peers.running_when_planned == [0, 0]
    reference = Engine.from_pretrained("default", dtype="float32")
    for name, prompt in (("first", first), ("second", second)):
        assert answers[name].status_code == 200
        expected = reference.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert answers[name].json()["output_ids"] == expected.output_ids
