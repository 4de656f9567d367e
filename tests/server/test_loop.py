"""The engine loop in process: errors stay with their request, the queue is bounded, admission by
state memory, and short requests are not held up behind a long cold one."""
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hypic import Engine, InvalidRequest
from hypic.cache.plan import RequestPlan
from hypic.prefill_stats import BuiltForRequest
from hypic.sampling.params import SamplingParams
from hypic.scheduler import loop as loop_module
from hypic.scheduler.loop import DoneEvent, EngineLoop, ErrorEvent, Event, LoopStopped, PeerWork, Phase, QueueFull
from hypic.server.protocol import GenerationRequest, LogprobRequest


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64)


class Collector:
    """Events of several jobs, and the order in which they finished."""

    def __init__(self) -> None:
        self.done: dict[str, Event] = {}
        self.order: list[str] = []
        self.finished = threading.Condition()

    def emit_for(self, name: str):
        def emit(event: Event) -> None:
            if isinstance(event, (DoneEvent, ErrorEvent)):
                with self.finished:
                    self.done[name], self.order = event, [*self.order, name]
                    self.finished.notify_all()
        return emit

    def wait(self, count: int, timeout: float = 120) -> None:
        with self.finished:
            assert self.finished.wait_for(lambda: len(self.done) >= count, timeout)


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnop ,.") for _ in range(n))


def _submit(loop: EngineLoop, collector: Collector, name: str, prompt: str, tokens: int = 4,
            peer_work: PeerWork | None = None):
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    parts = loop.engine.parse(prompt)
    request = GenerationRequest(prompt, params)
    return loop.submit(parts, request, loop.engine.sequences(params, parts.token_ids), collector.emit_for(name),
                       peer_work=peer_work)


@pytest.fixture
def running(engine: Engine) -> Iterator[EngineLoop]:
    loop = EngineLoop(engine, "hypic", max_running=8)
    loop.start()
    yield loop
    loop.stop()


def test_a_failing_sample_fails_its_request_alone(running: EngineLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    collector = Collector()
    jobs = {name: _submit(running, collector, name, _text(i, 40)) for i, name in enumerate("abc")}
    original = jobs["b"].sequences[0].step

    def broken(logits):
        original(logits)
        if len(jobs["b"].sequences[0].output_ids) == 2:
            raise RuntimeError("injected fault")

    monkeypatch.setattr(jobs["b"].sequences[0], "step", broken)
    collector.wait(3)
    assert isinstance(collector.done["b"], ErrorEvent) and "injected fault" in collector.done["b"].message
    for name in "ac":
        assert isinstance(collector.done[name], DoneEvent)
        assert len(collector.done[name].completion.samples[0].output_ids) == 4


def test_a_failing_decode_batch_is_retried_per_request(running: EngineLoop, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that raises is rolled back and each request decoded alone: only the culprit fails,
    and the others' outputs equal those of a clean run."""
    clean = Collector()
    for i, name in enumerate("xyz"):
        _submit(running, clean, name, _text(10 + i, 40), tokens=6)
    clean.wait(3)
    collector = Collector()
    jobs = {name: _submit(running, collector, name, _text(10 + i, 40), tokens=6) for i, name in enumerate("xyz")}
    real = running.engine.runner.decode

    def faulty(states, tokens):
        if any(state is jobs["y"].states[0] for state in states if jobs["y"].states) and len(
                jobs["y"].sequences[0].output_ids) >= 3:
            real(states, tokens)  # half of the work done in place, then the fault
            raise RuntimeError("injected decode fault")
        return real(states, tokens)

    monkeypatch.setattr(running.engine.runner, "decode", faulty)
    collector.wait(3)
    assert isinstance(collector.done["y"], ErrorEvent)
    for name in "xz":
        assert collector.done[name].completion.samples[0].output_ids == clean.done[name].completion.samples[0].output_ids


def test_queue_is_bounded(engine: Engine) -> None:
    loop = EngineLoop(engine, "hypic", max_queued=2)  # not started: nothing leaves the queue
    collector = Collector()
    for name in "ab":
        _submit(loop, collector, name, "a prompt")
    with pytest.raises(QueueFull, match="limit of 2 waiting requests"):
        _submit(loop, collector, "c", "a prompt")
    assert loop.stats.requests_refused == 1


def test_admission_waits_for_state_memory(engine: Engine) -> None:
    """Two requests that fit one at a time run one after the other; one that never fits is refused."""
    one = engine.state_bytes(100 + 8)
    loop = EngineLoop(engine, "hypic", max_state_bytes=int(1.5 * one))
    loop.start()
    try:
        collector = Collector()
        with pytest.raises(InvalidRequest, match="max-state-memory"):
            _submit(loop, collector, "huge", _text(1, 300))
        first = _submit(loop, collector, "first", _text(2, 100), tokens=8)
        second = _submit(loop, collector, "second", _text(3, 100), tokens=8)
        collector.wait(2)
        first_end = first.start + collector.done["first"].completion.e2e_s
        assert collector.order == ["first", "second"] and second.first_token_at > first_end
    finally:
        loop.stop()


def _done(value: Any = None, error: Exception | None = None) -> Future:
    future: Future = Future()
    future.set_exception(error) if error is not None else future.set_result(value)
    return future


def test_peer_work_starts_once_a_request_is_admitted_and_its_phases_follow(engine: Engine,
                                                                           tiny_checkpoint: Path) -> None:
    """Room for one request of two: the second's peer work is started only once the first has finished
    (QUEUED meanwhile). Phases: peers that leave the combine pass here, QUEUED BUILDING COMBINING DECODING;
    a peer that combines (its Prefill from another engine of the model, taken as it comes), with RECEIVING;
    peers that fail, the request alone here (counted). Every answer is a plain generation's."""
    one = engine.state_bytes(100 + 64)
    loop = EngineLoop(engine, "hypic", max_state_bytes=int(1.5 * one))
    loop.start()
    started_while_running: list[int] = []

    def local_combine(plan: RequestPlan) -> Future:
        started_while_running.append(loop.snapshot["running_requests"])
        return _done((None, BuiltForRequest()))

    other = Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64)
    prompts = {name: _text(seed, 100) for seed, name in enumerate(("first", "second", "remote", "broken"), 20)}
    remote = other.prefill(other.parse(prompts["remote"]))
    try:
        collector = Collector()
        jobs = {"first": _submit(loop, collector, "first", prompts["first"], tokens=64, peer_work=local_combine)}
        deadline = time.monotonic() + 30
        while loop.snapshot["running_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        jobs["second"] = _submit(loop, collector, "second", prompts["second"], tokens=8, peer_work=local_combine)
        jobs["remote"] = _submit(loop, collector, "remote", prompts["remote"], tokens=8,
                                 peer_work=lambda plan: _done((_done(remote), BuiltForRequest())))
        jobs["broken"] = _submit(loop, collector, "broken", prompts["broken"], tokens=8,
                                 peer_work=lambda plan: _done(error=ConnectionError("no peers")))
        collector.wait(4)
    finally:
        loop.stop()
    assert started_while_running == [0, 0]
    local = [Phase.QUEUED, Phase.BUILDING, Phase.COMBINING, Phase.DECODING]
    assert [jobs[name].phases for name in ("first", "second", "broken")] == [local] * 3
    assert jobs["remote"].phases == [Phase.QUEUED, Phase.BUILDING, Phase.RECEIVING, Phase.COMBINING, Phase.DECODING]
    assert jobs["remote"].prefill is remote and loop.snapshot["peer_prefill_failures"] == 1
    for name, prompt in prompts.items():
        expected = other.generate(prompt, max_new_tokens=64 if name == "first" else 8, ignore_eos=True).output_ids
        assert collector.done[name].completion.samples[0].output_ids == expected, name


def test_peers_build_while_another_prefill_runs_and_the_job_then_ranks_by_its_combine_pass(
        engine: Engine, tiny_checkpoint: Path) -> None:
    """One prefill a step: a cold 300-token prompt ranks before a PIC request with 3 cold 150-token
    documents, whose peer work (here: the documents built into this server's pool, as peers install
    them) starts at once, not after the other's prefill; with its documents in, its combine pass
    (seams and query) ranks first and finishes before the cold prompt's first token. Answers equal
    plain generation's."""
    from hypic import DEFAULT_SEPARATOR as SEP

    documents = [_text(seed, 150) for seed in (31, 32, 33)]
    pic = SEP.join(["lead", *documents, "which?"])
    loop = EngineLoop(engine, "hypic", max_prefill_batch=1)
    others_first_token: list[float | None] = []

    def build_on_peers(plan: RequestPlan) -> Future:
        others_first_token.append(jobs["cold"].first_token_at)
        engine.warmup(documents)
        return _done((None, BuiltForRequest()))

    collector = Collector()
    jobs = {"cold": _submit(loop, collector, "cold", _text(30, 300))}
    jobs["pic"] = _submit(loop, collector, "pic", pic, peer_work=build_on_peers)
    loop.start()
    try:
        collector.wait(2)
    finally:
        loop.stop()
    assert others_first_token == [None]
    assert jobs["pic"].first_token_at < jobs["cold"].first_token_at
    other = Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64)
    other.warmup(documents)
    for name, prompt in (("cold", _text(30, 300)), ("pic", pic)):
        assert collector.done[name].completion.samples[0].output_ids == other.generate(
            prompt, max_new_tokens=4, ignore_eos=True).output_ids, name


def test_a_batch_s_requests_wait_on_their_peers_together(engine: Engine, tiny_checkpoint: Path) -> None:
    """A batch of three PIC prompts (three jobs, as the HTTP layer submits a batch): the loop starts
    the peer work of all three before any of it is done, so their peers build concurrently, not one
    request's after another's; each answer equals plain generation's."""
    from hypic import DEFAULT_SEPARATOR as SEP

    release, started = threading.Event(), []

    def peer_work(plan: RequestPlan) -> Future:
        started.append(plan)
        future: Future = Future()
        threading.Thread(target=lambda: release.wait(30) and future.set_result((None, BuiltForRequest()))).start()
        return future

    prompts = {name: SEP.join(["lead", _text(seed, 80), _text(seed + 1, 60), f"which {name}?"])
               for name, seed in (("a", 41), ("b", 43), ("c", 45))}
    loop, collector = EngineLoop(engine, "hypic"), Collector()
    for name, prompt in prompts.items():
        _submit(loop, collector, name, prompt, peer_work=peer_work)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(started) == 3 and not collector.done  # all waiting on their peers at once
        release.set()
        collector.wait(3)
    finally:
        release.set()
        loop.stop()
    other = Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64)
    for name, prompt in prompts.items():
        assert collector.done[name].completion.samples[0].output_ids == other.generate(
            prompt, max_new_tokens=4, ignore_eos=True).output_ids, name


def test_peer_work_leaves_the_room_a_higher_ranked_job_here_takes(engine: Engine) -> None:
    """One running slot: a cold 100-token prompt ranks before a PIC request with peer work; the peer
    work does not take the slot first (which would make the better-ranked prompt wait for the other's
    whole request): it starts once the prompt has finished."""
    from hypic import DEFAULT_SEPARATOR as SEP

    documents = [_text(seed, 150) for seed in (41, 42)]
    loop = EngineLoop(engine, "hypic", max_running=1)
    finished_when_started: list[list[str]] = []

    def build_on_peers(plan: RequestPlan) -> Future:
        finished_when_started.append(collector.order)
        return _done((None, BuiltForRequest()))

    collector = Collector()
    _submit(loop, collector, "short", _text(40, 100))
    _submit(loop, collector, "pic", SEP.join(["lead", *documents, "which?"]), peer_work=build_on_peers)
    loop.start()
    try:
        collector.wait(2)
    finally:
        loop.stop()
    assert finished_when_started == [["short"]] and collector.order == ["short", "pic"]


def _decode_beside(engine: Engine, text: str | list[int]) -> tuple[list[float], Any]:
    """A request decoding 3000 tokens and, once it has 20, ``text`` (4 tokens): the decoding one's
    token times and the other's completion."""
    from hypic.scheduler.loop import ProgressEvent

    loop, collector, ticks = EngineLoop(engine, "hypic"), Collector(), []
    loop.start()
    try:
        params = SamplingParams(max_new_tokens=3000, ignore_eos=True)
        parts = engine.parse(_text(51, 20))
        emit = collector.emit_for("long")

        def timed(event: Event) -> None:
            if isinstance(event, ProgressEvent):
                ticks.append(time.perf_counter())
            emit(event)

        loop.submit(parts, GenerationRequest("", params, stream=True), engine.sequences(params, parts.token_ids), timed)
        while len(ticks) < 20:
            time.sleep(0.001)
        params2 = SamplingParams(max_new_tokens=4, ignore_eos=True)
        parts2 = engine.parse(text)
        loop.submit(parts2, GenerationRequest(text, params2), engine.sequences(params2, parts2.token_ids),
                    collector.emit_for("other"))
        collector.wait(2)
    finally:
        loop.stop()
    return ticks, collector.done["other"].completion


def _slowed(engine: Engine, kind: str) -> None:
    """Reads of the disk tier's files of ``kind`` (resume heads "r", or documents "") take 3 s more."""
    disk = engine.cache.resume_points.store.disk
    reading = disk.reading

    def slow(address: str):
        name = address.rpartition("/")[2]
        time.sleep(3.0 if (name[0] == "r" if kind == "r" else name[0] not in "rkm") else 0)
        return reading(address)

    disk.reading = slow


def test_decoding_goes_on_while_a_request_reads_its_resume_point_from_disk(tiny_checkpoint: Path,
                                                                           tmp_path: Path) -> None:
    """A conversation's turn 2 arrives while another request decodes; its resume point's read from
    disk is slowed to 3 s: the loop starts the request only once the read is done, so the decoding
    request's tokens never pause for it (the longest gap well under the read), and turn 2 resumes from
    disk with the answer of an engine that never resumed."""
    from hypic.cache.tiers.options import TierOptions

    tiers = TierOptions(str(tmp_path / "cache"))
    first = Engine.from_pretrained(tiny_checkpoint, tiers=tiers)
    prompt = list(first.parse(_text(50, 300)).token_ids)
    reply = first.generate(list(prompt), max_new_tokens=5, ignore_eos=True)
    first.close()
    turn2 = prompt + reply.output_ids + [65, 66]
    engine = Engine.from_pretrained(tiny_checkpoint, tiers=tiers)
    _slowed(engine, "r")
    ticks, completion = _decode_beside(engine, turn2)
    assert completion.prefill.disk_cached_tokens == len(prompt) + 4
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 1.5
    expected = Engine.from_pretrained(tiny_checkpoint).generate(turn2, max_new_tokens=4, ignore_eos=True)
    assert completion.samples[0].output_ids == expected.output_ids


def test_decoding_goes_on_while_a_request_waits_for_its_documents_from_disk(tiny_checkpoint: Path,
                                                                           tmp_path: Path) -> None:
    """Under --prefetch-policy wait_complete a request's two documents load from a disk slowed to 3 s
    each while another request decodes: the loop holds the request back until they are in (it never
    waits for them itself: the longest gap well under a load), then splices both, with the answer of
    an engine that built them."""
    from hypic import DEFAULT_SEPARATOR as SEP
    from hypic.cache.tiers.hierarchy import PrefetchPolicy
    from hypic.cache.tiers.options import TierOptions

    documents = [_text(60, 200), _text(61, 200)]
    first = Engine.from_pretrained(tiny_checkpoint, tiers=TierOptions(str(tmp_path / "cache")))
    first.warmup(documents)
    first.close()
    engine = Engine.from_pretrained(tiny_checkpoint, tiers=TierOptions(
        str(tmp_path / "cache"), prefetch_policy=PrefetchPolicy.WAIT_COMPLETE))
    _slowed(engine, "")
    text = SEP.join(["lead", *documents, "which?"])
    ticks, completion = _decode_beside(engine, text)
    assert completion.prefill.segments_hit == 2 and completion.prefill.disk_cached_tokens > 0
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 1.5
    expected = Engine.from_pretrained(tiny_checkpoint).generate(text, max_new_tokens=4, ignore_eos=True)
    assert completion.samples[0].output_ids == expected.output_ids


def test_a_request_whose_documents_load_too_slowly_starts_when_its_wait_runs_out(tiny_checkpoint: Path,
                                                                                tmp_path: Path) -> None:
    """Under the default prefetch policy (timeout: 0.2 s for entries this small) a request whose two
    documents take 5 s each to load starts when that wait runs out, though nothing else wakes the
    idle loop (its idle tick stretched to 10 s), and rebuilds them: its first token well before the
    tick or the loads."""
    from hypic import DEFAULT_SEPARATOR as SEP
    from hypic.cache.tiers.options import TierOptions

    documents = [_text(62, 200), _text(63, 200)]
    first = Engine.from_pretrained(tiny_checkpoint, tiers=TierOptions(str(tmp_path / "cache")))
    first.warmup(documents)
    first.close()
    engine = Engine.from_pretrained(tiny_checkpoint, tiers=TierOptions(str(tmp_path / "cache")))
    reading = engine.cache.resume_points.store.disk.reading

    def slow(address: str):
        time.sleep(5.0 if address.rpartition("/")[2][0] not in "rkm" else 0)
        return reading(address)

    engine.cache.resume_points.store.disk.reading = slow
    loop, collector = EngineLoop(engine, "hypic"), Collector()
    loop.idle_tick_s = 10.0
    loop.start()
    try:
        _submit(loop, collector, "late", SEP.join(["lead", *documents, "which?"]))
        collector.wait(1)
    finally:
        loop.stop()
    completion = collector.done["late"].completion
    assert completion.prefill.segments_missed == 2 and completion.ttft_s < 2.5


def test_a_request_cancelled_while_its_resume_point_is_read_leaves_nothing_held(tiny_checkpoint: Path,
                                                                                tmp_path: Path) -> None:
    """Cancelled while its resume point's read (slowed to 3 s) runs, a request ends without starting,
    and the lookup started for it is dropped, not kept for nobody."""
    from hypic.cache.tiers.options import TierOptions

    tiers = TierOptions(str(tmp_path / "cache"))
    first = Engine.from_pretrained(tiny_checkpoint, tiers=tiers)
    prompt = list(first.parse(_text(52, 300)).token_ids)
    prompt += first.generate(list(prompt), max_new_tokens=5, ignore_eos=True).output_ids
    first.close()
    engine = Engine.from_pretrained(tiny_checkpoint, tiers=tiers)
    _slowed(engine, "r")
    loop, collector = EngineLoop(engine, "hypic"), Collector()
    loop.start()
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        parts = engine.parse(prompt + [65, 66, 67, 68, 69, 70])
        job = loop.submit(parts, GenerationRequest("", params), engine.sequences(params, parts.token_ids),
                          collector.emit_for("gone"))
        deadline = time.monotonic() + 30
        while not job.loads and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(engine.cache.resume_points.store.prefetches) == 1
        job.cancel()
        collector.wait(1)
    finally:
        loop.stop()
    assert job.prefill is None and engine.cache.resume_points.store.prefetches == {} and loop.stats.requests_cancelled == 1


def test_samples_of_one_prompt_are_admitted_holding_it_once(engine: Engine) -> None:
    """n = 4 samples fork from one prefill and share its KV: a budget of the prompt's KV once, each
    sample's 8 new tokens and linear states (closed form) admits the request; counting the prompt
    per sample, as admission did before samples shared it, would refuse it."""
    config, prompt = engine.model.config, _text(5, 200)
    parts = engine.parse(prompt)
    kv_per_token = sum(config.kv_elements(i) for i in config.attention_layers()) * 4
    recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    linear = len(config.linear_layers()) * (recurrent + (config.linear_conv_kernel_dim - 1) * config.linear_conv_channels) * 4
    budget = (len(parts.token_ids) + 4 * 8) * kv_per_token + 4 * linear
    assert 4 * ((len(parts.token_ids) + 8) * kv_per_token + linear) > budget
    loop = EngineLoop(engine, "hypic", max_state_bytes=budget)
    loop.start()
    try:
        collector, params = Collector(), SamplingParams(max_new_tokens=8, ignore_eos=True, n=4, temperature=1.0, seed=3)
        loop.submit(parts, GenerationRequest(prompt, params), engine.sequences(params, parts.token_ids),
                    collector.emit_for("n4"))
        collector.wait(1)
    finally:
        loop.stop()
    samples = collector.done["n4"].completion.samples
    assert len(samples) == 4 and all(len(s.output_ids) == 8 for s in samples)


def _scored(loop: EngineLoop, collector: Collector, name: str, prompt: str) -> None:
    """Submit a greedy 6-token request that reports each output token's logprob."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    parts = loop.engine.parse(prompt)
    request = GenerationRequest(prompt, params, logprobs=LogprobRequest())
    loop.submit(parts, request, loop.engine.sequences(params, parts.token_ids, logprobs=0), collector.emit_for(name))


def test_a_pass_that_breaks_in_a_batch_fails_only_its_request(tiny_checkpoint: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Three requests' prefill passes run in one batch; the last one's raises in the attention
    layer, after the other two have appended their keys and values there. That request fails alone;
    the others are put back as they were and run alone, and their tokens and logprobs equal each
    request's run alone on a quiet engine."""
    from hypic import assembler

    prompts = {name: _text(60 + i, 70) for i, name in enumerate(["a", "c", "poisoned"])}  # poisoned last in the batch
    engine = Engine.from_pretrained(tiny_checkpoint, chunk_tokens=512)
    poison = engine.parse(prompts["poisoned"]).token_ids[:8]
    attend = assembler._full_attend

    def breaking(mixer, rope, proj, work, index, init, plan):
        if work.token_ids[:8] == poison:
            raise RuntimeError("a pass that breaks")
        return attend(mixer, rope, proj, work, index, init, plan)

    monkeypatch.setattr(assembler, "_full_attend", breaking)
    batches: list[int] = []
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda works: batches.append(len(works)) or run(works))
    loop, collector = EngineLoop(engine, "hypic"), Collector()
    for name, prompt in prompts.items():
        _scored(loop, collector, name, prompt)
    loop.start()
    try:
        collector.wait(3)
    finally:
        loop.stop()
    assert batches[0] == 3 and isinstance(collector.done["poisoned"], ErrorEvent)
    quiet, alone = EngineLoop(Engine.from_pretrained(tiny_checkpoint, chunk_tokens=512), "hypic"), Collector()
    quiet.start()
    try:
        for count, name in enumerate("ac", 1):
            _scored(quiet, alone, name, prompts[name])
            alone.wait(count)
    finally:
        quiet.stop()
    for name in "ac":
        ours, theirs = (c.done[name].completion.samples[0] for c in (collector, alone))
        assert ours.output_ids == theirs.output_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(ours.logprobs, theirs.logprobs)) < 1e-5


def test_short_requests_are_not_held_up_by_a_long_cold_one(engine: Engine) -> None:
    """A 3000-token cold prompt arrives first, five short ones just after: with 64-token prefill
    chunks chosen by uncached tokens left, the short ones finish first."""
    loop = EngineLoop(engine, "hypic")
    collector = Collector()
    _submit(loop, collector, "long", _text(4, 3000))
    for i in range(5):
        _submit(loop, collector, f"short{i}", _text(20 + i, 60))
    loop.start()
    try:
        collector.wait(6)
    finally:
        loop.stop()
    assert collector.order[-1] == "long"
    long_ttft = collector.done["long"].completion.ttft_s
    assert all(collector.done[f"short{i}"].completion.ttft_s < long_ttft / 2 for i in range(5))


def test_a_long_wait_earns_a_request_a_place_ahead_of_shorter_ones(engine: Engine) -> None:
    """One running slot; each request ranks by its uncached tokens less 256 tokens per second waited.
    A 600-token prompt that has waited 2 s longer than a 60- and a 300-token one ranks at 600 - 512
    = 88 against their 60 and 300: it overtakes the 300-token one (difference 300 < 512) and not
    the 60-token one (difference 540 > 512)."""
    assert loop_module.WAIT_CREDIT_TOKENS_PER_S == 256
    loop = EngineLoop(engine, "hypic", max_running=1, max_prefill_batch=1)
    collector = Collector()
    now = time.perf_counter()
    waited = {"long": 2.0, "medium": 0.0, "short": 0.0}
    sizes = {"long": 600, "medium": 300, "short": 60}
    jobs = {}
    for seed, name in enumerate(("medium", "short", "long")):  # in an order that is none of the expected ones
        rng = random.Random(70 + seed)
        prompt = [rng.randrange(3, 250) for _ in range(sizes[name])]  # token ids: exactly that many tokens
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        parts = engine.parse(prompt)
        jobs[name] = loop.submit(parts, GenerationRequest(prompt, params), engine.sequences(params, parts.token_ids),
                                 collector.emit_for(name), arrived=now - waited[name])
    assert {name: engine.cache.uncached_tokens(job.plan) for name, job in jobs.items()} == sizes  # all cold
    loop.start()
    try:
        collector.wait(3)
    finally:
        loop.stop()
    assert collector.order == ["short", "long", "medium"]


def test_over_http_short_requests_finish_before_a_long_cold_one(launch, checkpoint_factory) -> None:
    """A real server: a 14000-token cold request, then, once it is being prefilled, five short ones;
    the short ones come back first and their TTFTs are well below the long one's."""
    server = launch("--model", str(checkpoint_factory("qwen3_5_text-long-context")), "--chunked-prefill-size", "128")
    body = lambda text: {"text": text, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0}}  # noqa: E731
    finished: list[str] = []

    def send(name: str, text: str) -> dict:
        out = server.post("/generate", body(text))
        finished.append(name)
        return out["meta_info"]

    with ThreadPoolExecutor(6) as pool:
        long = pool.submit(send, "long", _text(30, 14000))
        deadline = time.monotonic() + 30
        while server.get("/get_server_info")["waiting_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the long one is being prefilled (a fixed sleep missed it on a fast box)
        shorts = [pool.submit(send, f"short{i}", _text(40 + i, 80)) for i in range(5)]
        metas = [s.result() for s in shorts]
        long_meta = long.result()
    assert finished[-1] == "long"
    assert max(m["ttft"] for m in metas) < long_meta["ttft"] / 2


def test_over_http_a_full_queue_answers_503_and_the_server_stays_healthy(launch) -> None:
    server = launch("--max-queued-requests", "2", "--max-running-requests", "1", "--chunked-prefill-size", "64")
    body = {"text": _text(50, 1500), "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: server.exchange("POST", "/generate", body), range(8)))
    statuses = sorted(status for status, _, _ in answers)
    assert statuses.count(200) >= 2 and 503 in statuses, statuses
    refused, headers = next((payload, headers) for status, payload, headers in answers if status == 503)
    assert "--max-queued-requests" in refused["error"]["message"] and int(headers["retry-after"]) > 0
    assert server.request("GET", "/health")[0] == 200
    assert server.get("/get_server_info")["requests_refused"] == statuses.count(503)


def test_the_counters_a_client_reads_after_its_answer_include_it(running: EngineLoop) -> None:
    """When a request's end, or a flush's, reaches its caller, the published counters already show it:
    a client that reads /get_server_info after its last chunk sees its own request counted."""
    seen: list[tuple[int, int]] = []
    before = running.snapshot["requests_finished"]

    def emit(event: Event) -> None:  # runs on the loop thread, when the HTTP side would hear of the end
        if isinstance(event, DoneEvent):
            seen.append((running.snapshot["requests_finished"], running.snapshot["prompt_tokens"]))

    prompt = _text(90, 40)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    parts = running.engine.parse(prompt)
    running.submit(parts, GenerationRequest(prompt, params), running.engine.sequences(params, parts.token_ids), emit)
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and seen[0][0] == before + 1 and seen[0][1] >= 40
    flushed: list[int] = []
    command = running.call(running.engine.flush)
    command.add_done_callback(lambda _: flushed.append(running.snapshot["private_pool"]["bytes"]))
    command.result(timeout=60)
    assert flushed == [0]


@pytest.mark.parametrize(("interval", "trims"), [("0.05", True), ("0", False)])
def test_the_loop_hands_freed_heap_memory_back_as_often_as_the_environment_says(
        engine: Engine, monkeypatch: pytest.MonkeyPatch, interval: str, trims: bool) -> None:
    """``HYPIC_HEAP_TRIM_S`` (which the Ray workers a server starts inherit) sets how often the loop
    trims the C heap between steps, busy or idle; 0 turns it off. The counters say so."""
    monkeypatch.setenv("HYPIC_HEAP_TRIM_S", interval)
    loop = EngineLoop(engine, "hypic", max_running=8)
    loop.start()
    try:
        collector = Collector()
        _submit(loop, collector, "one", _text(91, 60))
        collector.wait(1)
        time.sleep(1.6)  # idle, the loop wakes every 0.5 s: two trims at least, however fast the request ran
        loop.call(lambda: None).result(timeout=60)  # a command republishes the counters
    finally:
        loop.stop()
    assert (loop.snapshot["heap_trims"] >= 2) is trims and (loop.snapshot["heap_trims"] == 0) is not trims
    assert loop.snapshot["heap_trim_seconds"] >= 0 and loop.snapshot["heap_trimmed_bytes"] >= 0


def test_two_requests_for_one_new_document_build_it_once(tiny_checkpoint: Path) -> None:
    """Two requests that name one cold 300-token document (in 64-token chunks its build takes several
    steps) and one document each of their own, submitted together: the shared one is built once, by
    the first to reach it, while the other waits for it and then splices it as a hit; answers equal
    an engine that ran them one after the other."""
    from hypic import DEFAULT_SEPARATOR as SEP

    engine = Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64)
    shared, own = _text(41, 300), [_text(42, 120), _text(43, 120)]
    prompts = {f"r{i}": SEP.join(["lead", shared, own[i], "which?"]) for i in range(2)}
    built: list[tuple[int, ...]] = []
    entry_steps = engine.runner.entry_steps

    def counted(key: str, token_ids: tuple[int, ...], policy: Any):
        built.append(token_ids)
        return entry_steps(key, token_ids, policy)

    engine.runner.entry_steps = counted  # type: ignore[method-assign]
    loop = EngineLoop(engine, "hypic", max_prefill_batch=2)
    collector = Collector()
    for name, prompt in prompts.items():
        _submit(loop, collector, name, prompt)
    loop.start()
    try:
        collector.wait(2)
    finally:
        loop.stop()
    shared_ids = engine.parse(prompts["r0"]).segments[0]
    assert built.count(shared_ids) == 1 and len(built) == 3
    stats = [collector.done[name].completion.prefill for name in prompts]
    assert sorted((s.segments_hit, s.segments_missed) for s in stats) == [(0, 2), (1, 1)]
    other = Engine.from_pretrained(tiny_checkpoint, seam_width=4, chunk_tokens=64)
    for name, prompt in prompts.items():
        assert collector.done[name].completion.samples[0].output_ids == other.generate(
            prompt, max_new_tokens=4, ignore_eos=True).output_ids, name


class _Halt(BaseException):
    """Not an ``Exception``: what a bare ``except Exception`` lets through (as SystemExit would)."""


def test_whatever_ends_the_loop_every_waiting_client_hears_why_and_the_server_is_told(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``BaseException`` out of an iteration (not an ``Exception``) still ends the loop through its
    one boundary: the requests queued hear the cause at once, later submissions are refused with it,
    and ``on_fatal`` is told once."""
    told: list[str] = []
    loop = EngineLoop(engine, "hypic", on_fatal=told.append)

    def halt() -> None:
        raise _Halt("halted from inside an iteration")

    monkeypatch.setattr(loop, "iterate", halt)
    collector = Collector()
    for name in ("a", "b"):
        _submit(loop, collector, name, _text(50, 40))
    loop.start()
    collector.wait(2, timeout=10)
    loop._thread.join(timeout=10)
    assert not loop.alive and len(told) == 1 and "_Halt: halted from inside an iteration" in told[0]
    assert all(isinstance(collector.done[n], ErrorEvent) and "halted" in collector.done[n].message for n in "ab")
    with pytest.raises(LoopStopped, match="halted"):
        _submit(loop, collector, "late", _text(51, 40))


def test_the_load_a_loop_reports_counts_what_it_still_prefills_and_may_decode(engine: Engine) -> None:
    """Two requests waiting (300 and 40 prompt tokens still to prefill; a warm-up of 50 tokens; a
    worker's urgent combine pass, whose rank is not a token count) and one decoding (2 samples of 8
    new tokens: 3 made, and 5 made before a stop ended it, which owes nothing): the report a router
    adds up."""
    from hypic.scheduler.jobs import WarmupTask, queued_load
    from hypic.scheduler.policy import URGENT

    loop = EngineLoop(engine, "hypic")
    waiting = [_job_of(loop, _text(60, 300), 4), _job_of(loop, _text(61, 40), 4)]
    waiting[0].remaining, waiting[1].remaining = 300, 40
    decoding = _job_of(loop, _text(62, 40), 8, samples=2)
    for sequence, made in zip(decoding.sequences, (3, 5)):
        sequence.output_ids.extend([1] * made)
    decoding.sequences[1].finish_reason = "stop"
    tasks = [WarmupTask(iter(()), 50), WarmupTask(iter(()), URGENT)]  # type: ignore[arg-type]
    assert queued_load([*waiting, *tasks], [decoding]) == {
        "queued_prefill_tokens": 390, "requests": 3, "decode_tokens": 5}


def _job_of(loop: EngineLoop, prompt: str, tokens: int, samples: int = 1) -> Any:
    params = SamplingParams(max_new_tokens=tokens, n=samples, ignore_eos=True)
    parts = loop.engine.parse(prompt)
    return loop.job_for(parts, GenerationRequest(prompt, params), loop.engine.sequences(params, parts.token_ids))


def test_the_loop_counts_its_decode_steps_and_their_seconds(engine: Engine) -> None:
    """Two requests of 5 new tokens each, submitted together: the first token of each comes from its
    prefill, the other 4 from decode steps; decoded together they share steps, so 4 to 8 steps in all
    (8: never batched), their seconds between 0 and the loop's whole run (what a router reads a
    replica's decode step time from)."""
    loop, collector = EngineLoop(engine, "hypic", max_running=8), Collector()
    for name in "ab":
        _submit(loop, collector, name, _text(70 + ord(name), 40), tokens=5)
    start = time.perf_counter()
    loop.start()
    try:
        collector.wait(2)
    finally:
        loop.stop()
    took = time.perf_counter() - start
    counters = loop.snapshot
    assert all(len(collector.done[n].completion.samples[0].output_ids) == 5 for n in "ab")
    assert 4 <= counters["decode_steps"] <= 8 and 0 < counters["decode_seconds"] < took, counters
