"""The engine loop never dies silently: a fault injected at each step of an iteration fails only the
request it touches (with an error event naming it) or, where no request depends on the step, is
counted; either way the loop goes on and its next answer equals a full recompute's. A fault the
loop cannot place ends it, and then every waiting client hears why at once and nothing new is taken."""
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hypic import Engine
from hypic.sampling.params import SamplingParams
from hypic.scheduler.loop import DoneEvent, EngineLoop, ErrorEvent, Event, Job, LoopStopped
from hypic.server.launch import start_server
from hypic.server.protocol import GenerationRequest
import hypic_testing
from hypic_testing.exits import exits_within

TOKENS = 4
DEADLINE_S = 60


class Events:
    """The events each named request received, and a way to wait for its last one."""

    def __init__(self) -> None:
        self.last: dict[str, Event] = {}
        self.changed = threading.Condition()

    def emit_for(self, name: str) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            with self.changed:
                self.last[name] = event
                self.changed.notify_all()
        return emit

    def wait_end(self, name: str) -> Event:
        with self.changed:
            assert self.changed.wait_for(lambda: isinstance(self.last.get(name), (DoneEvent, ErrorEvent)), DEADLINE_S)
            return self.last[name]


def _until(condition: Callable[[], Any]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _prompt(seed: int) -> str:
    return " ".join(f"w{(seed * 7 + i) % 23}" for i in range(30))


def _submit(loop: EngineLoop, events: Events, name: str, prompt: str, tokens: int = TOKENS) -> Job:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    parts = loop.engine.parse(prompt)
    return loop.submit(parts, GenerationRequest(prompt, params), loop.engine.sequences(params, parts.token_ids),
                       events.emit_for(name))


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint: Path) -> Callable[[str], list[int]]:
    """Greedy tokens of a prompt by full recompute on an engine of its own."""
    engine = Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64)
    return lambda prompt: engine.generate(prompt, mode="full", max_new_tokens=TOKENS, ignore_eos=True).output_ids


@pytest.fixture
def loop(tiny_checkpoint: Path) -> Iterator[EngineLoop]:
    fatal: list[str] = []
    loop = EngineLoop(Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64), "hypic",
                      on_fatal=fatal.append)
    loop.fatal = fatal  # type: ignore[attr-defined]
    loop.start()
    yield loop
    loop.stop()


def _once(fault: str) -> Callable[..., Any]:
    """A callable that raises ``fault`` the first time it is called, then does nothing."""
    raised: list[bool] = []

    def fail(*_: Any, **__: Any) -> None:
        if not raised:
            raised.append(True)
            raise MemoryError(fault)
    return fail


def _wrap_once(target: Any, name: str, fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``target.name`` raises ``fault`` at its first call, and works as before afterwards."""
    real, fail = getattr(target, name), _once(fault)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        fail()
        return real(*args, **kwargs)
    monkeypatch.setattr(target, name, wrapped)


def _goes_on(loop: EngineLoop, oracle: Callable[[str], list[int]], seed: int = 99) -> None:
    """The loop still serves, and serves right: a new request's tokens equal a full recompute's."""
    events = Events()
    _submit(loop, events, "after", _prompt(seed))
    done = events.wait_end("after")
    assert isinstance(done, DoneEvent), done
    assert done.completion.samples[0].output_ids == oracle(_prompt(seed))
    assert loop.alive and loop.failure is None and not loop.fatal  # type: ignore[attr-defined]


@pytest.mark.parametrize("step", ["finish", "admit"])
def test_a_fault_in_a_request_s_step_fails_that_request_alone(loop: EngineLoop, oracle: Callable[[str], list[int]],
                                                             step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keeping a finished request's states (``insert_finished``) or starting its reads (``prefetch``)
    raises once: that request ends with an error event naming the fault, the others go on."""
    target = {"finish": "insert_finished", "admit": "prefetch"}[step]
    _wrap_once(loop.engine.cache, target, f"injected {step} fault", monkeypatch)
    events = Events()
    _submit(loop, events, "hit", _prompt(1))
    ended = events.wait_end("hit")
    assert isinstance(ended, ErrorEvent) and f"injected {step} fault" in ended.message
    assert loop.snapshot["requests_failed"] == 1
    _goes_on(loop, oracle)


def test_a_fault_while_dropping_a_cancelled_request_fails_it_alone(loop: EngineLoop, oracle: Callable[[str], list[int]],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    events = Events()
    job = _submit(loop, events, "gone", _prompt(2), tokens=1000)
    for sequence in job.sequences:
        monkeypatch.setattr(sequence, "abort", _once("injected drop fault"))
    _until(lambda: job.states)
    job.cancel()
    ended = events.wait_end("gone")
    assert isinstance(ended, ErrorEvent) and "injected drop fault" in ended.message
    _goes_on(loop, oracle)


@pytest.mark.parametrize("step", ["publish", "heap_trim"])
def test_a_fault_in_a_step_no_request_depends_on_is_counted(loop: EngineLoop, oracle: Callable[[str], list[int]],
                                                            step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counters' snapshot or a heap trim raises once: the loop logs and counts it, and every request
    is served."""
    if step == "publish":
        _wrap_once(loop, "_publish", "injected publish fault", monkeypatch)
    else:
        _wrap_once(loop.heap, "maybe", "injected trim fault", monkeypatch)
    _goes_on(loop, oracle, seed=3)
    _goes_on(loop, oracle)
    assert loop.snapshot["loop_errors"] == {step: 1}


@pytest.mark.parametrize(("part", "tiers"), [("flush_memory", {"memory"}), ("flush_below", {"memory", "disk"})])
def test_a_failing_flush_reaches_its_caller_and_the_loop_goes_on(loop: EngineLoop, oracle: Callable[[str], list[int]],
                                                                 part: str, tiers: set[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Emptying memory (on the loop thread) or the tiers below (on a thread of its own) raises: the
    caller of the flush gets the error, and the loop goes on."""
    _wrap_once(loop.engine.cache, part, "injected flush fault", monkeypatch)
    with pytest.raises(MemoryError, match="injected flush fault"):
        loop.flush(None, frozenset(tiers)).result(timeout=DEADLINE_S)
    _goes_on(loop, oracle)


def test_a_loop_that_cannot_go_on_tells_every_client_at_once(loop: EngineLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault no request owns (here: ranking the waiting work) ends the loop: every request in it, running
    or waiting, gets an error event naming the fault, a pending warm-up fails, whoever started the loop is
    told once, and later submissions are refused with ``LoopStopped``."""
    events = Events()
    for name in "abc":
        _submit(loop, events, name, _prompt(ord(name)), tokens=400)
    _until(lambda: len(loop.running) == 3)

    def broken() -> list[Any]:
        raise RuntimeError("injected scheduling fault")
    monkeypatch.setattr(loop, "_by_priority", broken)
    for name in "abc":
        ended = events.wait_end(name)
        assert isinstance(ended, ErrorEvent) and "injected scheduling fault" in ended.message
    loop._thread.join(timeout=DEADLINE_S)
    assert not loop.alive and "injected scheduling fault" in (loop.failure or "")
    assert len(loop.fatal) == 1 and "injected scheduling fault" in loop.fatal[0]  # type: ignore[attr-defined]
    with pytest.raises(LoopStopped, match="injected scheduling fault"):
        _submit(loop, events, "late", _prompt(5))
    with pytest.raises(LoopStopped):
        loop.warmup(["a late document"])
    with pytest.raises(LoopStopped):
        loop.call(lambda: None)


def test_a_loop_stuck_in_one_turn_past_its_watchdog_tells_every_client_and_stops_taking_work(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn that never ends (here: ranking the waiting work blocks on an event nobody sets): within
    the watchdog's 1 s and its polling, every request in the loop gets an error event naming the stall,
    whoever started the loop is told once, a flush queued behind the stuck turn fails, and later
    submissions are refused; ``/health``'s ``failure`` says why."""
    fatal: list[str] = []
    loop = EngineLoop(Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64), "hypic",
                      on_fatal=fatal.append, watchdog_s=1.0)
    loop.start()
    events, never, entered = Events(), threading.Event(), threading.Event()
    try:
        for name in "ab":
            _submit(loop, events, name, _prompt(ord(name)), tokens=400)
        _until(lambda: len(loop.running) == 2)
        monkeypatch.setattr(loop, "_by_priority", lambda: [entered.set(), never.wait(DEADLINE_S)])
        stuck = time.monotonic()
        assert entered.wait(DEADLINE_S)
        flushed = loop.flush(None, frozenset())  # queued behind the stuck turn
        for name in "ab":
            ended = events.wait_end(name)
            assert isinstance(ended, ErrorEvent) and "watchdog" in ended.message
        assert time.monotonic() - stuck < 3.0
        with pytest.raises(LoopStopped, match="watchdog"):
            flushed.result(timeout=5)
        assert len(fatal) == 1 and "inside one turn" in fatal[0] and "watchdog" in (loop.failure or "")
        with pytest.raises(LoopStopped, match="watchdog"):
            _submit(loop, events, "late", _prompt(5))
    finally:
        never.set()


def test_a_busy_loop_within_its_watchdog_is_left_alone(oracle: Callable[[str], list[int]],
                                                       tiny_checkpoint: Path) -> None:
    """Requests served one after another, and an idle wait many times longer than the deadline's
    polling, never trip a watchdog of 1 s: it counts a turn's work, not the time between requests."""
    fatal: list[str] = []
    watched = EngineLoop(Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64), "hypic",
                         on_fatal=fatal.append, watchdog_s=1.0)
    watched.fatal = fatal  # type: ignore[attr-defined]
    watched.start()
    try:
        _goes_on(watched, oracle, seed=7)
        time.sleep(2.5)
        _goes_on(watched, oracle, seed=8)
    finally:
        watched.stop()


@pytest.mark.parametrize(("fault", "trigger", "cause", "flags"), [
    ("loop", "BREAK-THE-LOOP", "a fault injected into the engine loop", []),
    ("loop_stall", "STALL-THE-LOOP", "past the watchdog's 2 s", ["--watchdog-timeout", "2"]),
])
def test_a_server_whose_loop_cannot_go_on_answers_its_clients_and_exits_non_zero(
        tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str, trigger: str, cause: str,
        flags: list[str]) -> None:
    """``hypic serve`` with a fault injected into its engine loop (``tests/helpers/faults``): the loop
    raises, or one of its turns blocks for good. The request that trips it and one already streaming
    both get an error naming the cause within seconds (not a hang), and the process exits non-zero
    within 10 s, the cause in its log."""
    helpers = Path(hypic_testing.__file__).parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(helpers / "faults"), str(helpers.parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYPIC_TEST_FAULT", fault)
    server = start_server(["--model", str(tiny_checkpoint), "--log-level", "warning", *flags], tmp_path / "server.log")
    try:
        assert server.post("/generate", {"text": "a request before the fault",
                                         "sampling_params": {"max_new_tokens": 2}})["meta_info"]
        streaming = ThreadPoolExecutor(1).submit(server.exchange, "POST", "/generate", {
            "text": "a long stream", "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}},
            timeout=30)
        time.sleep(0.5)
        status, body = server.request("POST", "/generate", {"text": trigger}, timeout=30)
        assert status == 500 and cause in body["error"]["message"]
        stream_status, stream_body = streaming.result(timeout=30)[:2]
        assert stream_status == 200 and cause in str(stream_body)
    except BaseException:
        server.stop()
        raise
    exits_within(server, 10)
    assert cause in server.log.read_text()


def test_a_negative_watchdog_timeout_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from hypic.cli import main

    assert main(["serve", "--watchdog-timeout", "-1"]) == 2
    assert "--watchdog-timeout must be >= 0" in capsys.readouterr().err
