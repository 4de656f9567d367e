"""A flush that reaches below memory runs off the loop thread: decoding goes on meanwhile, requests
of other namespaces start and finish, and only requests of the namespace being flushed wait for it."""
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hypic import Engine
from hypic.cache.tiers.options import TierOptions
from hypic.sampling.params import SamplingParams
from hypic.scheduler.loop import DoneEvent, EngineLoop, ErrorEvent, Event, ProgressEvent
from hypic.server.protocol import GenerationRequest

FLUSH_S = 3.0  # how long the disk's flush is made to take
DEADLINE_S = 60


class Timeline:
    """When each named request took each token and ended (``time.monotonic``)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[float]] = {}
        self.ended: dict[str, tuple[float, Event]] = {}
        self.lock = threading.Lock()

    def emit_for(self, name: str):
        def emit(event: Event) -> None:
            with self.lock:
                if isinstance(event, ProgressEvent):
                    self.tokens.setdefault(name, []).append(time.monotonic())
                elif isinstance(event, (DoneEvent, ErrorEvent)):
                    self.ended[name] = (time.monotonic(), event)
        return emit

    def wait(self, *names: str) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not all(name in self.ended for name in names):
            assert time.monotonic() < deadline
            time.sleep(0.01)


def _submit(loop: EngineLoop, timeline: Timeline, name: str, prompt: str, tokens: int, namespace: str = "") -> None:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    parts = loop.engine.parse(prompt, namespace)
    loop.submit(parts, GenerationRequest(prompt, params, stream=True), loop.engine.sequences(params, parts.token_ids),
                timeline.emit_for(name))


def _slow_disk_flush(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The disk tier's flush sleeps ``FLUSH_S`` first; returns where it notes when it ended."""
    disk = next(tier for tier in engine.cache.public.lower.tiers if tier.name == "disk")
    real, ended = disk.flush, []

    def slow(namespace_dir: Any) -> int:
        time.sleep(FLUSH_S)
        dropped = real(namespace_dir)
        ended.append(time.monotonic())
        return dropped
    monkeypatch.setattr(disk, "flush", slow)
    return ended


def test_a_slow_flush_below_memory_holds_back_only_its_namespace(tiny_checkpoint: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint, seam_width=4, tiers=TierOptions(str(tmp_path / "cache")))
    engine.warmup(["a document of the tenant, long enough to be kept on the disk " * 3], namespace="tenant")
    flush_ended = _slow_disk_flush(engine, monkeypatch)
    loop, timeline = EngineLoop(engine, "hypic"), Timeline()
    loop.start()
    try:
        _submit(loop, timeline, "decoding", "a long answer follows", tokens=4000)
        while len(timeline.tokens.get("decoding", [])) < 3:
            time.sleep(0.01)
        flushed = loop.flush("tenant", frozenset({"memory", "disk"}))
        time.sleep(0.2)
        _submit(loop, timeline, "tenant", "a request of the namespace being flushed", tokens=2, namespace="tenant")
        _submit(loop, timeline, "other", "a request of another namespace", tokens=2, namespace="other")
        public, private, lower = flushed.result(timeout=DEADLINE_S)
        timeline.wait("tenant", "other")
        decoding = [t for t in timeline.tokens["decoding"] if t < flush_ended[0]]
    finally:
        loop.stop()
    assert public == 1 and lower == {"disk": 1}
    assert max(b - a for a, b in zip(decoding, decoding[1:])) < FLUSH_S / 2  # no pause for the flush
    assert timeline.ended["other"][0] < flush_ended[0]  # not held back
    assert timeline.tokens["tenant"][0] > flush_ended[0]  # held back until the flush was done
    assert all(isinstance(event, DoneEvent) for _, event in timeline.ended.values())
