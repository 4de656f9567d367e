"""The engine loop: one thread owns the Engine; others talk to it through messages on its queue
(the server's HTTP handlers and peer work, a Ray worker's calls), which it drains between chunks.

Each iteration runs one batch of prefill work, then decodes one token for every running sample in
one batch (continuous batching: requests join and leave between iterations). Several prefills may
be in flight, each asking for its next combine pass (a chunk of a cold segment, of a warm-up, or
of the combine pass); taken smallest first by uncached tokens left, less a credit for the time
waited (so a long cold request does not hold up short ones, and is not starved by them), as many
passes as fit one chunk's tokens run through the model together (``ModelRunner.run``).
A request starts only when the state it may hold fits ``max_state_bytes``; the waiting queue is
bounded. An error in one request fails that request only. A request's n samples share its prefill.
"""
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from ..assembler import CombineResult, CombineWork, Steps
from ..engine import Engine
from ..prefill import Prefill
from ..cache.plan import RequestPlan
from ..cache.store import Load
from ..cache.modes import Mode
from ..errors import HypicError, InvalidRequest
from ..heap import HeapTrimmer, heap_trim_interval
from ..prefill_stats import BuiltForRequest, PrefillStats
from ..cache.segments import PromptParts
from ..sequence import Sequence, TokenLogprob, token_logprob
from ..state import RequestState, tensor_bytes
from .policy import URGENT, WAIT_CREDIT_TOKENS_PER_S, SchedulingPolicy
from .requests import Completion, Request, SampleResult
from .stats import LoopStats

log = logging.getLogger("hypic.server")


def default_prefill_batch(device: str) -> int:
    """Prefill passes one step runs together by default: 16 on a GPU (where batching pays), 1 on a CPU
    (compute-bound already: batching there gains nothing)."""
    return 16 if device.startswith("cuda") else 1


class QueueFull(HypicError):
    """The waiting queue holds ``max_queued`` requests already (the app answers 503)."""


class LoopStopped(HypicError):
    """The engine loop has stopped after a fault and serves nothing more (the app answers 503)."""


@dataclass
class ProgressEvent:
    """Sample ``index`` took a token (``completion`` is the request as it stands)."""

    index: int
    completion: Completion


@dataclass
class DoneEvent:
    completion: Completion


@dataclass
class ErrorEvent:
    message: str


Event = ProgressEvent | DoneEvent | ErrorEvent


def input_logits_from(request: Request, prompt_tokens: int) -> int | None:
    """The first prompt position whose logits the request needs (input logprobs), or None."""
    return None if request.logprobs is None else request.logprobs.input_from(prompt_tokens)


PeerWork = Callable[[RequestPlan], Future]  # starts a request's peer work on its plan, on the loop thread; the future: (remote Prefill future or None, built)


class Phase(StrEnum):
    """Where a request stands in the loop. A request with peers is admitted (room for its state) before
    anything is built or shipped for it; without peers it goes from QUEUED to COMBINING."""

    QUEUED = "queued"  # waiting for a running slot and room for its state memory
    BUILDING = "building"  # admitted; its documents built here and on peers, their entries arriving
    RECEIVING = "receiving"  # its combine pass runs on a peer; the state is on its way here
    COMBINING = "combining"  # its prefill on this loop (documents missed, the combine pass), in chunks
    DECODING = "decoding"


@dataclass(eq=False)
class Job:
    """A request inside the loop: its prompt, its samples, and where its events go."""

    rid: str
    parts: PromptParts
    request: Request
    mode: Mode
    sequences: list[Sequence]
    emit: Callable[[Event], None]
    plan: RequestPlan  # what its prefill reuses (``Engine.plan``), worked out when it is submitted
    cancelled: threading.Event = field(default_factory=threading.Event)
    start: float = field(default_factory=time.perf_counter)
    steps: Steps[Prefill] | None = None
    work: CombineWork | None = None  # the combine pass its steps asked for, not run yet
    prefill: Prefill | None = None
    states: list[RequestState] = field(default_factory=list)  # one per sample, once prefilled
    first_token_at: float | None = None
    input_logprobs: list[TokenLogprob | None] | None = None
    remaining: int = 0  # about how many prompt tokens its prefill still computes
    footprint: int = 0  # bytes of state its samples may hold (prompt + max_new_tokens each)
    remote: Future | None = None  # its Prefill computed elsewhere (another worker); None: here
    built: BuiltForRequest = field(default_factory=BuiltForRequest)  # computed for it before its prefill
    peer_work: PeerWork | None = None  # started when it is admitted: its documents built on peers
    peer: Future | None = None  # that work under way: (remote Prefill future or None, built)
    # reads below memory started as it arrived (documents, its resume point), each with until when
    # (time.monotonic) it waits for them before it starts
    loads: list[Load] = field(default_factory=list)
    admitted: bool = False  # it holds a running slot and its state memory
    serial: int = -1  # its number in a lockstep loop's records (tensor parallelism; else unused)
    held_back: bool | None = None  # a lockstep loop's frozen ``looking_up`` for this iteration (None: live)
    phases: list[Phase] = field(default_factory=lambda: [Phase.QUEUED])  # every phase it entered, in order

    @property
    def phase(self) -> Phase:
        return self.phases[-1]

    @property
    def awaiting(self) -> bool:
        """Whether it waits on work elsewhere: its reads below memory (``looking_up``), its peers'
        builds, or its combine pass on a peer."""
        peers_busy = self.peer is not None and not self.peer.done()
        return self.looking_up or peers_busy or (self.remote is not None and self.steps is None and not self.remote.done())

    @property
    def looking_up(self) -> bool:
        """Whether it still waits, before it starts, for what it reads below memory: its documents as
        long as the prefetch policy says, its resume point ``resume.LOOKUP_WAIT_S`` at most (then it
        starts, and its prefill takes what is in, as without the wait)."""
        if self.held_back is not None:
            return self.held_back
        return bool(self.holds(time.monotonic()))

    def holds(self, now: float) -> list[float]:
        """Until when (``time.monotonic``) each read it is still held back for runs; none once admitted."""
        return [] if self.admitted else [until for future, until in self.loads if not future.done() and now < until]

    def cancel(self) -> None:
        """Safe from any thread: the loop drops the job at its next iteration."""
        self.cancelled.set()

    @property
    def logits_from(self) -> int | None:
        return input_logits_from(self.request, len(self.parts.token_ids))

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


@dataclass(eq=False)
class WarmupTask:
    """Documents to cache (or a request's head to combine early), run in chunks between decode
    steps like a prefill."""

    steps: Steps[Any]
    remaining: int
    future: Future = field(default_factory=Future)
    work: CombineWork | None = None
    start: float = field(default_factory=time.perf_counter)
    footprint: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    serial: int = -1  # its number in a lockstep loop's records
    source: tuple[str, list[Any], str] | None = None  # ("warmup" | "build", documents or segments, namespace)


Pending = Job | WarmupTask


@dataclass
class Command:
    """Quick work (a flush) run on the loop thread between iterations."""

    run: Callable[[], Any]
    future: Future = field(default_factory=Future)


def wake_only() -> None:
    """A command that does nothing: it wakes the loop (a load or a peer's work finished)."""


def _abandon(item: "Pending | Command", message: str) -> None:
    """Tell whoever waits on ``item`` that the loop stopped (``message``)."""
    if isinstance(item, Job):
        item.emit(ErrorEvent(message))
    elif not item.future.done():
        item.future.set_exception(LoopStopped(message))


def _nobody_told(message: str) -> None:
    """The default ``on_fatal``: the loop's clients heard of it already; nothing else is told."""


class Solo:
    """How a loop that runs alone keeps time and makes its passes through the model; the lockstep
    loops' ``RankSync`` agrees on each of them with the other tensor-parallel ranks."""

    def model_call(self, run: Callable[[], Any], batch: list[int]) -> Any:
        """``run()``, one pass through the model over ``batch`` (serials and sizes, in order)."""
        return run()

    def failed(self) -> None:
        """A request or a warm-up failed."""

    def sampled(self, serial: int, index: int, token: int) -> None:
        """Sample ``index`` of request ``serial`` took ``token``."""


def input_logprobs(prompt_ids: list[int], start: int, logits: torch.Tensor, top: int) -> list[TokenLogprob | None]:
    """Logprob of each prompt token from position ``start`` (None for the first: nothing before it
    is scored), from the logits [len - start, vocab] at positions start..len-1."""
    scored = [token_logprob(logits[i - start - 1], prompt_ids[i], top) for i in range(start + 1, len(prompt_ids))]
    return [None, *scored]


class EngineLoop:
    """Owns ``engine`` on a background thread; ``submit``, ``warmup`` and ``call`` are safe from any
    thread. ``max_state_bytes``: the memory running and prefilling requests' states may take
    together (None: no bound); ``max_queued``: requests that may wait (more are refused);
    ``max_prefill_batch``: the most prefill passes one step runs together."""

    def __init__(self, engine: Engine, mode: Mode | str, max_running: int = 64, max_queued: int = 256,
                 max_state_bytes: int | None = None, max_prefill_batch: int = 16,
                 on_fatal: Callable[[str], None] = _nobody_told, sync: "Solo | None" = None) -> None:
        self.engine, self.mode, self.max_running = engine, Mode.parse(mode), max_running
        self.sync = sync or Solo()  # how its model passes and outcomes are kept alike with other ranks
        self.policy = SchedulingPolicy(max_running, max_state_bytes)
        self.flushing: list[str | None] = []  # namespaces whose tiers below memory are being flushed (None: all)
        self.on_fatal = on_fatal  # told why, once, if the loop cannot go on (a server exits non-zero)
        self.stopped: str | None = None  # why the loop stopped after a fault
        self.max_prefill_batch = max_prefill_batch  # prefill passes run together in one step, at most
        self.max_queued, self.max_state_bytes = max_queued, max_state_bytes
        self.inbox: queue.Queue[Pending | Command | None] = queue.Queue()
        self.waiting: list[Pending] = []
        self.running: list[Job] = []
        self.stats = LoopStats()
        self.heap = HeapTrimmer(heap_trim_interval())  # freed memory handed back now and then (see hypic.heap)
        self._queued, self._queued_lock = 0, threading.Lock()
        self.snapshot: dict[str, Any] = self._publish()
        self._thread = threading.Thread(target=self._main, name="hypic-engine-loop", daemon=True)

    # ----- other threads --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=30)

    def _enqueue(self, item: Pending) -> None:
        with self._queued_lock:
            if self.stopped is not None:
                raise LoopStopped(self.stopped)
            if self._queued >= self.max_queued:
                self.stats.requests_refused += 1
                raise QueueFull(f"the server is at its limit of {self.max_queued} waiting requests "
                                "(--max-queued-requests): try again shortly")
            self._queued += 1
        self.inbox.put(item)

    def submit(self, parts: PromptParts, request: Request, sequences: list[Sequence],
               emit: Callable[[Event], None], arrived: float | None = None,
               peer_work: PeerWork | None = None) -> Job:
        """Queue a validated request whose samples (``Engine.sequences``) are ready to run.
        ``arrived``: when it reached the server (``time.perf_counter``; its TTFT and latency count
        from there); ``peer_work``: with peers, what starts its documents' builds there, called once
        the request is admitted (a slot and room for its state), so nothing is built or shipped
        for a request that must wait; if that work fails, the request is prefilled here alone."""
        plan = self.engine.plan(parts, self.mode, input_logits_from(request, len(parts.token_ids)))  # off the loop thread
        job = Job(request.rid or f"hypic-{uuid.uuid4().hex[:16]}", parts, request, self.mode, sequences, emit, plan,
                  peer_work=peer_work)
        if arrived is not None:
            job.start = arrived
        job.footprint = self.check_state_fits(parts, request, len(sequences))
        self._enqueue(job)
        return job

    def check_state_fits(self, parts: PromptParts, request: Request, samples: int) -> int:
        """The state bytes a request may hold (KV of the prompt, which its samples share, and of
        max_new_tokens and linear states per sample); raises ``InvalidRequest`` if that can never
        fit ``max_state_bytes`` (checked before any of its work starts, here or on peers)."""
        prompt = len(parts.token_ids)
        footprint = self.engine.state_bytes(prompt + request.params.max_new_tokens, samples, shared_tokens=prompt)
        if self.max_state_bytes is not None and footprint > self.max_state_bytes:
            raise InvalidRequest(f"the request's state may take {footprint} bytes (KV of prompt + max_new_tokens "
                                 f"and linear states, times n), over the server's --max-state-memory of "
                                 f"{self.max_state_bytes} bytes")
        return footprint

    def warmup(self, documents: list[str], namespace: str = "") -> Future:
        """Cache documents in the server's mode and cache ``namespace``, in chunks; the future holds
        their token counts. Bad documents raise here, before anything is queued."""
        steps = self.engine.warmup_steps(documents, self.mode, namespace)
        task = WarmupTask(steps, sum(len(self.engine.tokenizer.encode(d)) for d in documents),
                          source=("warmup", list(documents), namespace))
        self._enqueue(task)
        return task.future

    def build(self, segments: list[tuple[int, ...]], namespace: str = "") -> Future:
        """Cache tokenized documents in the server's mode and cache ``namespace``, in chunks like a warm-up."""
        task = WarmupTask(self.engine.build_steps(segments, self.mode, namespace), sum(map(len, segments)),
                          source=("build", list(segments), namespace))
        self._enqueue(task)
        return task.future

    def precombine(self, plan: RequestPlan, built: BuiltForRequest, arriving: frozenset[str] = frozenset()) -> Future:
        """Combine the head of the planned request this engine already holds while its peers' last
        documents are on their way (``Engine.precombine_steps``; those keyed in ``arriving`` left out
        of it), in chunks like a warm-up; the future holds the head's ``PrefillStats`` (None:
        nothing to combine early)."""
        task = WarmupTask(self.engine.prefiller.precombine_steps(plan, built, arriving), len(plan.parts.token_ids))
        if self._queued >= self.max_queued:  # never refused as a request would be: it is combined later instead
            task.future.set_result(None)
        else:
            self._enqueue(task)
        return task.future

    def run_steps(self, steps: Steps[Any], priority: float = URGENT) -> Future:
        """Run any prefill work (a Ray worker's builds and combine passes) in chunks among the loop's
        other work, in order of ``priority`` (tokens its request still needs; ``URGENT``: before any of
        them); the future holds what ``steps`` return."""
        task = WarmupTask(steps, priority)
        self._enqueue(task)
        return task.future

    def call(self, run: Callable[[], Any]) -> Future:
        """Run ``run`` on the loop thread when the loop next drains its queue (between chunks); the
        future holds its result or exception. Peer work posts its news this way and never waits."""
        command = Command(run)
        with self._queued_lock:
            if self.stopped is not None:
                raise LoopStopped(self.stopped)
            self.inbox.put(command)
        return command.future

    def flush(self, namespace: str | None, tiers: frozenset[str]) -> Future:
        """``Engine.flush`` without stopping the loop: memory between two of its steps, the tiers below
        on a thread of their own while decoding goes on; meanwhile no request of ``namespace`` (None:
        of any) starts. The future holds the counts."""
        flushed: Future = Future()
        self.call(lambda: self._start_flush(namespace, tiers, flushed))
        return flushed

    def _start_flush(self, namespace: str | None, tiers: frozenset[str], flushed: Future) -> None:
        try:
            public, private = self.engine.cache.flush_memory(namespace) if "memory" in tiers else (0, 0)
        except Exception as err:  # noqa: BLE001 - handed to the flush's caller
            flushed.set_exception(err)
            return
        if not tiers - {"memory"}:
            flushed.set_result((public, private, {}))
            return
        self.flushing.append(namespace)

        def below() -> None:
            try:
                outcome: Any = (public, private, self.engine.cache.flush_below(namespace, tiers))
            except Exception as err:  # noqa: BLE001 - handed to the flush's caller
                outcome = err
            self.inbox.put(Command(lambda: self._flushed(namespace, flushed, outcome)))
        threading.Thread(target=below, name="hypic-flush", daemon=True).start()

    def _flushed(self, namespace: str | None, flushed: Future, outcome: Any) -> None:
        """The tiers below are flushed: requests of ``namespace`` may start again."""
        self.flushing.remove(namespace)
        if isinstance(outcome, Exception):
            flushed.set_exception(outcome)
        else:
            flushed.set_result(outcome)

    def sample_seed(self) -> int | None:
        """The seed an unseeded request's samples draw from (None: torch's generator; a lockstep loop
        draws one, so every rank samples alike)."""
        return None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the loop can no longer serve (it stopped after a fault; a tensor-parallel rank died while
        its thread runs on); None: it can."""
        return self.stopped

    # ----- loop thread ----------------------------------------------------------------------
    def _main(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while self._turn():
                pass
        except BaseException as err:  # noqa: BLE001 - whatever ends the loop, its clients hear of it
            self._die(err)

    def _turn(self) -> bool:
        """Drain the inbox (waiting for news when idle), then one iteration; False once stopped."""
        if not self._drain(self._idle_wait() if self._idle() else None):
            return False
        self._iterate()
        return True

    def _idle(self) -> bool:
        return not self.running and all(isinstance(p, Job) and p.awaiting for p in self.waiting)

    def _iterate(self) -> None:
        """One iteration after the inbox is drained: cancellations, peers, a prefill step, a decode step,
        now and then a heap trim. What fails inside a request's work fails that request; what escapes
        from here ends the loop (``_die``)."""
        self._drop_cancelled()
        self._start_peer_work()
        self._take_peer_work()
        self._step_prefills()
        if self.running:
            self._decode()
        self._quietly("heap_trim", self.heap.maybe)  # every loop's iteration, the lockstep loops' too: per process
        self._republish()

    def _quietly(self, step: str, run: Callable[[], Any]) -> None:
        """Run a step no request depends on (a heap trim, the counters' snapshot): a failure is logged
        and counted, and the loop goes on."""
        try:
            run()
        except Exception:  # noqa: BLE001 - nobody waits on this step
            self.stats.loop_errors[step] = self.stats.loop_errors.get(step, 0) + 1
            log.exception("the engine loop's %s failed; the loop goes on", step.replace("_", " "))

    def _republish(self) -> None:
        """A new snapshot of the counters (the last one stays if making it fails)."""
        self._quietly("publish", lambda: setattr(self, "snapshot", self._publish()))

    def _die(self, err: BaseException) -> None:
        """The loop cannot go on: later submissions are refused, every client still waiting hears why
        at once, and ``on_fatal`` is told (a server exits non-zero)."""
        message = f"the engine loop stopped ({type(err).__name__}: {err})"
        log.critical("%s", message, exc_info=err)
        with self._queued_lock:
            self.stopped = message
        for item in [*self.waiting, *self.running, *self._inbox_left()]:
            _abandon(item, message)
        self.on_fatal(message)

    def _inbox_left(self) -> list[Pending | Command]:
        items = []
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return items
            if item is not None:
                items.append(item)

    def _idle_wait(self) -> float:
        """How long an idle loop waits for news: until the first hold on a waiting job's reads runs
        out (it starts then, loaded or not), 0.5 s at most."""
        now = time.monotonic()
        holds = [until - now for p in self.waiting if isinstance(p, Job) for until in p.holds(now)]
        return max(0.001, min([0.5, *holds]))

    def _drain(self, wait_s: float | None) -> bool:
        """Take everything queued (waiting up to ``wait_s`` for the first item; None: not at all);
        False on shutdown."""
        for item in self._inbox_items(wait_s):
            if item is None:
                return False
            if isinstance(item, Command):
                self._run_command(item)
            else:
                self._admit(item)
        return True

    def _inbox_items(self, wait_s: float | None) -> Iterator[Pending | Command | None]:
        """What the inbox holds now, waiting up to ``wait_s`` for the first item (None: not at all);
        ends after a None (shutdown)."""
        try:
            item = self.inbox.get(timeout=wait_s) if wait_s is not None else self.inbox.get_nowait()
            while item is not None:
                yield item
                item = self.inbox.get_nowait()
            yield None
        except queue.Empty:
            return

    def _admit(self, item: Pending) -> None:
        """Into the waiting list; a request's reads below memory start (a failure fails it alone)."""
        self.waiting.append(item)
        if isinstance(item, Job):
            self.stats.requests_received += 1
            self._guarded(item, self._look_up)

    def _look_up(self, job: Job) -> None:
        job.remaining = self.engine.cache.uncached_tokens(job.plan)
        job.loads = self.engine.cache.prefetch(job.plan)  # its documents and resume point are read meanwhile
        for future, _ in job.loads:
            self._wake_when_done(future)

    def _leave_queue(self, item: Pending) -> None:
        if item in self.waiting:
            self.waiting.remove(item)
            with self._queued_lock:
                self._queued -= 1

    def _run_command(self, command: Command) -> None:
        try:
            result = command.run()
        except Exception as err:  # handed to the caller, who reports it
            command.future.set_exception(err)
            return
        self._republish()  # whoever reads the counters once it is done sees it (a flush's empty pools)
        command.future.set_result(result)

    # ----- scheduling -----------------------------------------------------------------------
    def _held_bytes(self) -> int:
        """State memory that running and admitted requests may hold."""
        admitted = sum(p.footprint for p in self.waiting if isinstance(p, Job) and p.admitted)
        return sum(job.footprint for job in self.running) + admitted

    def _startable(self, pending: Pending) -> bool:
        """A prefill under way continues unless it waits on peers; a new one needs a running slot and room."""
        if isinstance(pending, WarmupTask):
            return True
        if pending.admitted:
            return not pending.awaiting
        return not pending.looking_up and self._fits(pending)

    def _fits(self, job: Job, slots_ahead: int = 0, bytes_ahead: int = 0) -> bool:
        """Whether a new job gets a running slot and room for its state beside the running and admitted
        ones and what jobs ahead of it, about to start, will take (``slots_ahead``, ``bytes_ahead``)."""
        if None in self.flushing or job.parts.namespace in self.flushing:
            return False  # its namespace's entries are being deleted below memory
        started = sum(1 for p in self.waiting if isinstance(p, Job) and p.admitted)
        return self.policy.admits(len(self.running) + started + slots_ahead, self._held_bytes() + bytes_ahead,
                                  job.footprint)

    def _start_peer_work(self) -> None:
        """Admit every job with peer work that fits now, in priority order, so its peers build while
        this server runs other prefills (the prefill steps admit a job only when they reach it); the
        room a job ahead of it will take here stays that job's."""
        slots_ahead = bytes_ahead = 0
        for pending in self._by_priority():
            if not isinstance(pending, Job) or pending.admitted or pending.looking_up:
                continue
            if not self._fits(pending, slots_ahead, bytes_ahead):
                continue
            if pending.peer_work is None:
                slots_ahead, bytes_ahead = slots_ahead + 1, bytes_ahead + pending.footprint
            else:
                self._admit_to_run(pending)

    def _admit_to_run(self, job: Job) -> bool:
        """The job holds its slot and room from now on; with peer work, that starts (BUILDING) and
        the job waits on it (False); else its prefill starts here (True)."""
        job.admitted = True
        if job.peer_work is None:
            return True
        start, job.peer_work = job.peer_work, None
        job.phases.append(Phase.BUILDING)
        try:
            job.peer = start(job.plan)
        except Exception as err:  # noqa: BLE001 - peers that cannot even start cost only speed
            job.peer = Future()
            job.peer.set_exception(err)
        self._wake_when_done(job.peer)
        return False

    def _wake_when_done(self, future: Future) -> None:
        """The loop's next iteration runs as soon as ``future`` is done (it may be blocked waiting)."""
        future.add_done_callback(lambda _: self.inbox.put(Command(wake_only)))

    def _take_peer_work(self) -> None:
        """Take the outcome of every job's finished peer work (``_peer_outcome``)."""
        for job in list(self.waiting):
            if isinstance(job, Job) and job.peer is not None and job.peer.done():
                self._guarded(job, self._peer_outcome)

    def _peer_outcome(self, job: Job) -> None:
        """The job's peer work is done: its combine pass runs on a peer (RECEIVING) or here; a failure
        only costs speed (the request runs here alone)."""
        assert job.peer is not None
        peer, job.peer = job.peer, None
        try:
            job.remote, job.built = peer.result()
        except Exception as err:  # noqa: BLE001 - a broken peer path must not fail the request
            self.stats.peer_prefill_failures += 1
            log.warning("peer prefill of %s failed (%s: %s); it runs on this worker alone", job.rid,
                        type(err).__name__, err)
            return
        if job.remote is not None:
            job.phases.append(Phase.RECEIVING)
            self._wake_when_done(job.remote)
        else:  # its documents are in the pool now: it ranks by what its combine pass computes
            job.remaining = self.engine.cache.uncached_tokens(job.plan)

    def _by_priority(self) -> list[Pending]:
        """Waiting work in the policy's order."""
        return self.policy.order(self.waiting)

    def _step_prefills(self) -> None:
        """One batch of prefill work: startable prefills and warm-ups in priority order, each resumed
        to the combine pass it asks for next, as many as fit one chunk's tokens (at least one)."""
        batch, budget = [], self.engine.chunk_tokens
        for pending in self._by_priority():
            if pending not in self.waiting or not self._startable(pending):
                continue
            if isinstance(pending, Job) and not pending.admitted and not self._admit_to_run(pending):
                continue  # its peer work just started
            if pending.work is None and not self._resume(pending, None):
                continue  # it ended (a remote prefill taken, a warm-up of cached documents) or failed
            if pending.work is None or (batch and pending.work.tokens > budget):
                continue  # a pause (its turn), or it waits for a step with room
            batch.append(pending)
            budget -= pending.work.tokens
            if budget <= 0 or len(batch) == self.max_prefill_batch:
                break
        if batch:
            self._run(batch)

    def _run(self, batch: list[Pending]) -> None:
        """The batch's combine passes in one pass through the model, each result sent back to its
        steps. If the batch fails, each pass is put back and run alone: only a failing one fails."""
        works = [p.work for p in batch if p.work is not None]
        restores = [work.checkpoint() for work in works] if len(works) > 1 else []
        try:
            results: list[CombineResult] = self.sync.model_call(lambda: self.engine.runner.run(works),
                                                                [v for p in batch for v in (p.serial, p.work.tokens)])
        except Exception as err:
            if len(batch) == 1:
                self._broke(batch[0], err)
                return
            for restore in restores:
                restore()
            for pending in batch:
                self._run([pending])
            return
        for pending, work, result in zip(batch, works, results):
            pending.remaining = self.policy.left(pending.remaining, work.tokens)
            self._resume(pending, result)

    def _resume(self, pending: Pending, reply: CombineResult | None) -> bool:
        """Send ``reply`` to the pending's steps (a job's are made at its first turn): it asks for its
        next combine pass (``pending.work``) or pauses (None), or it ends or breaks (False)."""
        if isinstance(pending, Job) and pending.steps is None:
            pending.steps = self._prefill_steps(pending)
            pending.phases.append(Phase.COMBINING)
        assert pending.steps is not None
        try:
            pending.work = pending.steps.send(reply)
            return True
        except StopIteration as done:
            pending.work = None
            self._ended(pending, done.value)
        except Exception as err:
            pending.work = None
            self._broke(pending, err)
        return False

    def _ended(self, pending: Pending, value: Any) -> None:
        if isinstance(pending, WarmupTask):
            self._leave_queue(pending)
            pending.future.set_result(value)
        else:
            self._guarded(pending, lambda job: self._prefilled(job, value))

    def _broke(self, pending: Pending, err: Exception) -> None:
        """A warm-up that breaks fails alone; a request's error fails that request."""
        if isinstance(pending, WarmupTask):
            self.sync.failed()
            self._leave_queue(pending)
            pending.future.set_exception(err)
        else:
            self._fail(pending, err)

    # ----- one request ----------------------------------------------------------------------
    def _guarded(self, job: Job, step: Callable[[Job], None]) -> None:
        """Run one job's step; an unexpected error fails that job only."""
        try:
            step(job)
        except Exception as err:
            self._fail(job, err)

    def _fail(self, job: Job, err: Exception) -> None:
        """The job ends with an error event; it hears of it even if letting go of what it holds fails."""
        log.error("request %s failed: %s: %s", job.rid, type(err).__name__, err, exc_info=err)
        self.stats.requests_failed += 1
        self.sync.failed()
        try:
            self._remove(job)
            self._release(job)
        finally:
            job.emit(ErrorEvent(f"internal error while serving the request: {type(err).__name__}: {err}"))

    def _drop_cancelled(self) -> None:
        for pending in [p for p in (*self.waiting, *self.running) if p.cancelled.is_set()]:
            self._drop(pending)

    def _drop(self, pending: Pending) -> None:
        """A cancelled request stops (its client went away); a cancelled warm-up runs on."""
        if isinstance(pending, Job):
            self.stats.requests_cancelled += 1
            self._guarded(pending, self._stop)

    def _stop(self, job: Job) -> None:
        for sequence in job.sequences:
            sequence.abort()
        self._finish(job)

    def _prefill_steps(self, job: Job) -> Steps[Prefill]:
        """The job's remote Prefill, or its prefill here (also when the remote one failed)."""
        if job.remote is not None:
            try:
                return job.remote.result()
            except Exception as err:  # a lost combine node: prefill here instead
                log.warning("remote prefill of %s failed (%s: %s); prefilling here", job.rid, type(err).__name__, err)
        return (yield from self.engine.prefiller.prefill_steps(job.plan)).for_request(job.built)

    def _prefilled(self, job: Job, prefill: Prefill) -> None:
        """The job's prefill is done: its samples start decoding from it (the first token now)."""
        job.prefill = prefill
        self._leave_queue(job)
        self.stats.add_prefill(job.prefill.stats)
        if job.logits_from is not None and job.prefill.prompt_logits is not None:
            assert job.request.logprobs is not None
            job.input_logprobs = input_logprobs(job.parts.token_ids, job.logits_from, job.prefill.prompt_logits,
                                                job.request.logprobs.top)
        job.phases.append(Phase.DECODING)
        state = job.prefill.state  # decode grows each sample's state in place: every sample owns one
        job.states = [state] + [state.fork() for _ in job.sequences[1:]]
        for sample_state in job.states:
            sample_state.reserve(state.length + job.request.params.max_new_tokens)
        self.running.append(job)
        for index, sequence in enumerate(job.sequences):
            if not sequence.finished:
                self._accept(job, index, job.prefill.logits)
        if job.finished:
            self._finish(job)

    def _decode(self) -> None:
        rows = [(job, i) for job in self.running for i, s in enumerate(job.sequences) if not s.finished]
        states = [job.states[i] for job, i in rows]
        marks = [state.mark() for state in states]
        try:
            logits, _ = self.sync.model_call(
                lambda: self.engine.runner.decode(states, [job.sequences[i].output_ids[-1] for job, i in rows]),
                [v for (job, i), state in zip(rows, states) for v in (job.serial, i, state.length)])
        except Exception:
            for state, mark in zip(states, marks):
                state.rollback(mark)
            self._decode_one_by_one(rows)
            return
        for row, (job, index) in enumerate(rows):
            if job in self.running:  # not failed on an earlier sample of this step
                self._guarded(job, lambda j, i=index, r=row: self._accept(j, i, logits[r]))
        self._finish_done()

    def _decode_one_by_one(self, rows: list[tuple[Job, int]]) -> None:
        """After a failed batch: each sample alone, so that only a failing request fails."""
        for job, index in rows:
            if job in self.running:
                self._guarded(job, lambda j, i=index: self._accept(j, i, self.sync.model_call(
                    lambda: self.engine.runner.decode([j.states[i]], [j.sequences[i].output_ids[-1]]),
                    [j.serial, i, j.states[i].length])[0][0]))
        self._finish_done()

    def _finish_done(self) -> None:
        for job in [job for job in self.running if job.finished]:
            self._guarded(job, self._finish)

    def _accept(self, job: Job, index: int, logits: torch.Tensor) -> None:
        """Sample ``index`` of ``job`` takes its next token from ``logits``; the client hears of it."""
        job.sequences[index].step(logits)
        self.sync.sampled(job.serial, index, job.sequences[index].output_ids[-1])
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        self.stats.generated_tokens += 1
        if job.request.stream:  # a non-streaming client hears only of the end
            job.emit(ProgressEvent(index, self._completion(job)))

    def _finish(self, job: Job) -> None:
        self._remove(job)
        for state in job.states:  # each sample's prompt + output, for the next turn of a conversation
            self.engine.cache.insert_finished(state, self.engine.policy(job.mode, job.parts.namespace))
        self._release(job)
        completion = self._completion(job)
        self.stats.add_finished(completion)
        self._republish()  # a client that reads the counters after its last chunk sees its request
        job.emit(DoneEvent(completion))

    @staticmethod
    def _release(job: Job) -> None:
        """The private-pool pages a finished job read may be evicted again (released here, on the
        loop thread, not whenever the HTTP side drops the job)."""
        for state in job.states:
            state.release()

    def _completion(self, job: Job) -> Completion:
        now = time.perf_counter()
        samples = [SampleResult(s.text, list(s.output_ids), s.finish_reason, s.matched_stop, list(s.logprobs))
                   for s in job.sequences]
        return Completion(
            rid=job.rid, samples=samples, prompt_ids=job.parts.token_ids,
            prefill=job.prefill.stats if job.prefill is not None else PrefillStats(),
            ttft_s=(job.first_token_at or now) - job.start, e2e_s=now - job.start, mode=job.mode,
            input_logprobs=job.input_logprobs)

    def _remove(self, job: Job) -> None:
        if job in self.running:
            self.running.remove(job)
        self._leave_queue(job)
        if job.steps is not None:
            job.steps.close()  # releases the public entries its prefill pinned
        else:
            self.engine.cache.discard_prefetch(job.plan)  # gone before it started: what was read for it is dropped

    def _by_phase(self) -> dict[str, int]:
        """Requests in the loop by phase."""
        counts = {phase.value: 0 for phase in Phase}
        for job in (*self.running, *self.waiting):
            if isinstance(job, Job):
                counts[job.phase.value] += 1
        return counts

    def _shared_bytes(self) -> int:
        """Bytes of the KV blocks running requests read without owning them (private-pool pages,
        prompts their samples share), each counted once."""
        blocks = {k.data_ptr(): tensor_bytes(k, v) for job in self.running for s in job.states
                  for k, v in s.shared_blocks()}
        return sum(blocks.values())

    def _publish(self) -> dict[str, Any]:
        """A consistent copy of the numbers the HTTP side reports (read without locks)."""
        return {
            **self.stats.as_dict(), **self.heap.as_dict(), "waiting_requests": len(self.waiting),
            "running_requests": len(self.running),
            "held_state_bytes": self._held_bytes(), "max_state_bytes": self.max_state_bytes,
            "requests_by_phase": self._by_phase(),
            "running_state_bytes": {"full": sum(s.nbytes - s.window_nbytes for j in self.running for s in j.states),
                                    "sliding_window": sum(s.window_nbytes for j in self.running for s in j.states)},
            "running_shared_bytes": self._shared_bytes(),
            **self.engine.cache.describe(),
        }
