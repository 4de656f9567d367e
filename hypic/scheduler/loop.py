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
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from ..assembler import Steps
from ..engine import Engine
from ..cache.plan import RequestPlan
from ..cache.modes import Mode
from ..errors import InvalidRequest
from ..heap import HeapTrimmer, heap_trim_interval
from ..intake import RequestIntake
from ..prefill_stats import BuiltForRequest
from ..cache.segments import PromptParts
from ..sampling.sequence import Sequence
from .batching import Batching
from .flushes import BackgroundFlushes
from .inbox import Inbox
from .jobs import (  # noqa: F401 - the events, errors and items are named from here by the loop's callers
    Command, DoneEvent, ErrorEvent, Event, FlushCommand, Job, LoopStopped, PeerWork, Pending, Phase, ProgressEvent,
    QueueFull, WarmupTask, abandon, by_phase, held_bytes, input_logits_from, queued_load, shared_bytes, state_bytes,
    wake_only)
from .peer_stage import PeerStage
from .policy import URGENT, WAIT_CREDIT_TOKENS_PER_S, SchedulingPolicy  # noqa: F401 - re-exported
from .requests import Request
from .stats import LoopStats
from .sync import Solo
from .watchdog import Watchdog

log = logging.getLogger("hypic.server")


def default_prefill_batch(device: str) -> int:
    """Prefill passes one step runs together by default: 16 on a GPU (where batching pays), 1 on a CPU
    (compute-bound already: batching there gains nothing)."""
    return 16 if device.startswith("cuda") else 1


def _unheard(_: Event) -> None:
    """A job's events before it is queued: none are sent."""


def _nobody_told(message: str) -> None:
    """The default ``on_fatal``: the loop's clients heard of it already; nothing else is told."""


def state_footprint(engine: RequestIntake, policy: SchedulingPolicy, parts: PromptParts, request: Request,
                    samples: int) -> int:
    """The state bytes a request may hold (KV of the prompt, which its samples share, and of
    max_new_tokens and linear states per sample); raises ``InvalidRequest`` if that can never fit the
    policy's ``max_state_bytes`` (checked before any of its work starts, here or on peers)."""
    prompt = len(parts.token_ids)
    footprint = engine.state_bytes(prompt + request.params.max_new_tokens, samples, shared_tokens=prompt)
    if not policy.ever_fits(footprint):
        raise InvalidRequest(f"the request's state may take {footprint} bytes (KV of prompt + max_new_tokens "
                             f"and linear states, times n), over the server's --max-state-memory of "
                             f"{policy.max_state_bytes} bytes")
    return footprint


def planned_job(engine: RequestIntake, mode: Mode, policy: SchedulingPolicy, parts: PromptParts, request: Request,
                sequences: list[Sequence], plan: RequestPlan | None = None) -> Job:
    """A validated request as a loop runs it, planned once (``engine.plan``: its keys and layout; or
    ``plan``, made where the request arrived) and its state footprint checked (``state_footprint``);
    pure, so its caller may make it on any thread. Its TTFT counts from now (set ``start`` to when it
    reached the server)."""
    plan = plan or engine.plan(parts, mode, input_logits_from(request, len(parts.token_ids)))
    job = Job(request.rid or f"hypic-{uuid.uuid4().hex[:16]}", parts, request, mode, sequences, _unheard, plan)
    job.footprint = state_footprint(engine, policy, parts, request, len(sequences))
    return job


class ServingLoop(Protocol):
    """What the HTTP app (``hypic.server.app``) drives: one engine loop in this process
    (``EngineLoop``) or the ingress's face over a replicated service's replicas
    (``hypic.cluster.ingress.ReplicaLoop``). Requests are made into jobs with ``job_for`` on the
    caller's thread, then handed over with ``enqueue``."""

    engine: Any  # its ``RequestIntake``: an ``Engine``, or the ingress's weightless ``FrontEngine``
    mode: Mode
    policy: SchedulingPolicy  # what a request's state may take (refused at once if it never fits)
    snapshot: dict[str, Any]  # the counters as last published

    @property
    def alive(self) -> bool: ...

    @property
    def failure(self) -> str | None: ...

    def sample_seed(self) -> int | None: ...

    def job_for(self, parts: PromptParts, request: Request, sequences: list[Sequence],
                plan: RequestPlan | None = None) -> Job: ...

    def enqueue(self, job: Job, emit: Callable[[Event], None], peer_work: PeerWork | None = None) -> Job: ...

    def warmup(self, documents: list[str], namespace: str = "") -> Future: ...

    def flush(self, namespace: str | None, tiers: frozenset[str]) -> Future: ...


class EngineLoop(Batching):
    """Owns ``engine`` on a background thread; ``submit``, ``warmup`` and ``call`` are safe from any
    thread. ``max_state_bytes``: the memory running and prefilling requests' states may take
    together (None: no bound); ``max_queued``: requests that may wait (more are refused);
    ``max_prefill_batch``: the most prefill passes one step runs together."""

    idle_tick_s = 0.5  # an idle loop looks at its waiting jobs at least this often

    def __init__(self, engine: Engine, mode: Mode | str, max_running: int = 64, max_queued: int = 256,
                 max_state_bytes: int | None = None, max_prefill_batch: int = 16,
                 on_fatal: Callable[[str], None] = _nobody_told, sync: "Solo | None" = None,
                 watchdog_s: float | None = None) -> None:
        self.engine, self.mode = engine, Mode.parse(mode)
        self.sync = sync or Solo()  # how it takes its turns and keeps in step with other ranks (Solo: alone)
        self.policy = SchedulingPolicy(max_running, max_state_bytes)
        self.on_fatal = on_fatal  # told why, once, if the loop cannot go on (a server exits non-zero)
        self.max_prefill_batch = max_prefill_batch  # prefill passes run together in one step, at most
        self.max_queued = max_queued
        self.stats = LoopStats()
        self.inbox = Inbox(max_queued, self.stats)
        self.flushes = BackgroundFlushes(engine.cache, self.inbox.put)
        self.peers = PeerStage(self._wake_when_done, self.stats)
        self.serials = itertools.count()  # each request and warm-up numbered in the order it is taken
        self.waiting: list[Pending] = []
        self.running: list[Job] = []
        self.heap = HeapTrimmer(heap_trim_interval())  # freed memory handed back now and then (see hypic.heap)
        self.snapshot: dict[str, Any] = self._publish()
        self.watchdog = Watchdog(watchdog_s)  # a turn longer than this ends the loop (None: no deadline)
        self._thread = threading.Thread(target=self._main, name="hypic-engine-loop", daemon=True)

    # ----- other threads --------------------------------------------------------------------
    def start(self) -> None:
        self.watchdog.beat()
        self._thread.start()
        self.watchdog.watch(self._end, lambda: self.alive and self.failure is None)  # on its thread: the loop's is stuck

    def stop(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, parts: PromptParts, request: Request, sequences: list[Sequence],
               emit: Callable[[Event], None], arrived: float | None = None,
               peer_work: PeerWork | None = None) -> Job:
        """Queue a validated request whose samples (``Engine.sequences``) are ready to run: ``job_for``,
        then ``enqueue``."""
        job = self.job_for(parts, request, sequences)
        if arrived is not None:
            job.start = arrived
        return self.enqueue(job, emit, peer_work)

    def job_for(self, parts: PromptParts, request: Request, sequences: list[Sequence],
                plan: RequestPlan | None = None) -> Job:
        """``planned_job`` of this loop's engine, mode and policy."""
        return planned_job(self.engine, self.mode, self.policy, parts, request, sequences, plan)

    def enqueue(self, job: Job, emit: Callable[[Event], None], peer_work: PeerWork | None = None) -> Job:
        """Queue ``job`` (``job_for``), its events to ``emit``. ``peer_work``: with peers, what starts its
        documents' builds there, called once the request is admitted (a slot and room for its state),
        so nothing is built or shipped for a request that must wait; if that work fails, the request
        is prefilled here alone."""
        job.emit = emit
        if peer_work is not None:
            self.peers.add(job, peer_work)
        try:
            self.inbox.enqueue(job)
        except BaseException:
            self.peers.forget(job)
            raise
        return job

    def warmup(self, documents: list[str], namespace: str = "") -> Future:
        """Cache documents in the server's mode and cache ``namespace``, in chunks; the future holds
        their token counts. Bad documents raise here, before anything is queued."""
        steps = self.engine.warmup_steps(documents, self.mode, namespace)
        task = WarmupTask(steps, sum(len(self.engine.tokenizer.encode(d)) for d in documents),
                          source=("warmup", list(documents), namespace))
        self.inbox.enqueue(task)
        return task.future

    def build(self, segments: list[tuple[int, ...]], namespace: str = "") -> Future:
        """Cache tokenized documents in the server's mode and cache ``namespace``, in chunks like a warm-up."""
        task = WarmupTask(self.engine.build_steps(segments, self.mode, namespace), sum(map(len, segments)),
                          source=("build", list(segments), namespace))
        self.inbox.enqueue(task)
        return task.future

    def precombine(self, plan: RequestPlan, built: BuiltForRequest, arriving: frozenset[str] = frozenset()) -> Future:
        """Combine the head of the planned request this engine already holds while its peers' last
        documents are on their way (``Engine.precombine_steps``; those keyed in ``arriving`` left out
        of it), in chunks like a warm-up; the future holds the head's ``PrefillStats`` (None:
        nothing to combine early)."""
        task = WarmupTask(self.engine.prefiller.precombine_steps(plan, built, arriving), len(plan.parts.token_ids))
        if self.inbox.full:  # never refused as a request would be: it is combined later instead
            task.future.set_result(None)
        else:
            self.inbox.enqueue(task)
        return task.future

    def run_steps(self, steps: Steps[Any], priority: float = URGENT) -> Future:
        """Run any prefill work (a Ray worker's builds and combine passes) in chunks among the loop's
        other work, in order of ``priority`` (tokens its request still needs; ``URGENT``: before any of
        them); the future holds what ``steps`` return."""
        task = WarmupTask(steps, priority)
        self.inbox.enqueue(task)
        return task.future

    def call(self, run: Callable[[], Any]) -> Future:
        """Run ``run`` on the loop thread when the loop next drains its queue (between chunks); the
        future holds its result or exception. Peer work posts its news this way and never waits."""
        command = Command(run)
        self.inbox.command(command)
        return command.future

    def flush(self, namespace: str | None, tiers: frozenset[str]) -> Future:
        """``Engine.flush`` without stopping the loop: memory between two of its steps, the tiers below
        on a thread of their own while decoding goes on; meanwhile no request of ``namespace`` (None:
        of any) starts. The future holds the counts (under tensor parallelism every rank flushes
        everything at once, between two iterations)."""
        flushed: Future = Future()
        self.inbox.command(FlushCommand(lambda: self.flushes.start(namespace, tiers, flushed), namespace=namespace,
                                        tiers=tiers, flushed=flushed))
        return flushed

    def sample_seed(self) -> int | None:
        """The seed an unseeded request's samples draw from (None: torch's generator; a lockstep loop
        draws one, so every rank samples alike)."""
        return self.sync.sample_seed()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the loop can no longer serve (it stopped after a fault; a tensor-parallel rank died while
        its thread runs on); None: it can."""
        return self.sync.failure() or self.inbox.stopped

    # ----- loop thread ----------------------------------------------------------------------
    def _main(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while self.turn():
                self.watchdog.beat()
        except BaseException as err:  # noqa: BLE001 - whatever ends the loop, its clients hear of it
            self._die(err)

    def turn(self) -> bool:
        """One turn, as its ``sync`` takes it (alone: drain the inbox, then ``iterate``); False once stopped."""
        return self.sync.turn(self)

    def iterate(self) -> None:
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
        self.sync.before_end(err)
        self._end(f"the engine loop stopped ({type(err).__name__}: {err})", err)

    def _end(self, message: str, err: BaseException | None = None) -> None:
        """Stop serving with ``message``: refuse what comes, tell every client in the loop, tell ``on_fatal``."""
        log.critical("%s", message, exc_info=err)
        for item in [*self.waiting, *self.running, *self.inbox.close(message)]:
            abandon(item, message)
        self.on_fatal(message)

    def idle_wait(self) -> float | None:
        """How long the loop may wait for news before its next iteration: None (not at all) unless it
        is idle (nothing running, every waiting job held back); then until the first hold on a waiting
        job's reads runs out (it starts then, loaded or not), ``idle_tick_s`` at most."""
        if self.running or not all(isinstance(p, Job) and self._awaiting(p) for p in self.waiting):
            return None
        now = time.monotonic()
        holds = [until - now for p in self.waiting if isinstance(p, Job) for until in p.holds(now)]
        return max(0.001, min([self.idle_tick_s, *holds]))

    def drain(self, wait_s: float | None) -> bool:
        """Take everything queued (waiting up to ``wait_s`` for the first item; None: not at all);
        False on shutdown."""
        for item in self.inbox.items(wait_s):
            if item is None:
                return False
            if isinstance(item, Command):
                self.run_command(item)
            else:
                self.admit(item)
        return True

    def admit(self, item: Pending) -> None:
        """Into the waiting list; a request's reads below memory start (a failure fails it alone)."""
        if item.serial < 0:  # a lockstep follower's items come numbered by rank 0
            item.serial = next(self.serials)
        self.sync.admitted(item)
        self.waiting.append(item)
        if isinstance(item, Job):
            self.stats.requests_received += 1
            self._guarded(item, self._look_up)

    def _look_up(self, job: Job) -> None:
        job.remaining = self.engine.cache.uncached_tokens(job.plan)
        job.loads = self.engine.cache.prefetch(job.plan)  # its documents and resume point are read meanwhile
        for future, _ in job.loads:
            self._wake_when_done(future)

    def run_command(self, command: Command) -> None:
        try:
            result = command.run()
        except Exception as err:  # handed to the caller, who reports it
            command.future.set_exception(err)
            return
        self._republish()  # whoever reads the counters once it is done sees it (a flush's empty pools)
        command.future.set_result(result)

    def _wake_when_done(self, future: Future) -> None:
        """The loop's next iteration runs as soon as ``future`` is done (it may be blocked waiting)."""
        future.add_done_callback(lambda _: self.inbox.put(Command(wake_only)))

    def _publish(self) -> dict[str, Any]:
        """A consistent copy of the numbers the HTTP side reports (read without locks)."""
        return {
            **self.stats.as_dict(), **self.heap.as_dict(), "waiting_requests": len(self.waiting),
            "running_requests": len(self.running),
            "held_state_bytes": held_bytes(self.waiting, self.running), "max_state_bytes": self.policy.max_state_bytes,
            "requests_by_phase": by_phase((*self.running, *self.waiting)),
            "load": queued_load(self.waiting, self.running),
            "running_state_bytes": state_bytes(self.running), "running_shared_bytes": shared_bytes(self.running),
            **self.engine.cache.describe(),
        }
