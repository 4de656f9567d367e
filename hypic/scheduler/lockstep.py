"""The engine loop over N tensor-parallel ranks, in lockstep. Rank 0 (the server) runs the loop as one
process would, except that every iteration starts by broadcasting an ``Iteration``: a plain-data
record of everything the iteration takes from outside the loop (what was drained from the inbox,
the requests cancelled, which requests still wait for their reads below memory, the clock). Every
other rank (``FollowerLoop``) applies it and runs the same iteration on its own shard, so every rank
makes the same cache decisions and the same model calls in the same order.

At the end of each iteration the ranks compare, in one small all-reduce, how many requests failed
and the tokens they sampled: if they disagree, or a pass through the model fails on any rank (its
peers would wait in a collective it never reaches), the group ends (``RanksOutOfStep``)."""
import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..cache.plan import RequestPlan
from ..errors import HypicError
from ..parallel.group import TensorParallel, from_rank_zero, same_on_every_rank
from .loop import Command, EngineLoop, Event, Job, Pending, WarmupTask, wake_only
from .requests import Request

log = logging.getLogger("hypic.server")
NAME_THE_RANK_S = 1.5  # a failed collective waits this long for the watchdog to name the rank that died


class RanksOutOfStep(BaseException):
    """The ranks can no longer go on together (a model call failed on one, or they disagree on an
    iteration's outcome): the group ends. A BaseException, so no per-request handler takes it."""


@dataclass(frozen=True)
class JobRecord:
    """A request as rank 0 admitted it: its plan (computed once, on rank 0), its request, the seed its
    samples draw from (rank 0's for an unseeded request), and rank 0's numbers for it."""

    serial: int
    rid: str
    plan: RequestPlan
    request: Request
    seed: int | None
    start: float
    footprint: int
    remaining: int


@dataclass(frozen=True)
class WarmupRecord:
    """A warm-up (``("warmup", documents, namespace)``) or a build (``("build", token segments, namespace)``):
    each rank makes its own steps from it."""

    serial: int
    source: tuple[str, list[Any], str]
    remaining: float
    start: float


@dataclass(frozen=True)
class FlushRecord:
    namespace: str | None
    tiers: frozenset[str]


Item = JobRecord | WarmupRecord | FlushRecord


@dataclass(frozen=True)
class Iteration:
    """What rank 0 broadcasts before each iteration. ``cancelled``: serials of requests dropped now;
    ``held``: serials of waiting requests still held back for their reads below memory; ``clock``:
    rank 0's ``time.perf_counter`` (priorities' waiting credit); ``stop``: the server stops."""

    items: list[Item]
    cancelled: frozenset[int]
    held: frozenset[int]
    clock: float
    stop: bool = False


STOP = Iteration([], frozenset(), frozenset(), 0.0, stop=True)


@dataclass
class FlushCommand(Command):
    """A flush, named so that the other ranks make it too (closures cannot be sent)."""

    namespace: str | None = None
    tiers: frozenset[str] = frozenset()


class Ranks(Protocol):
    """The group rank 0 leads (``hypic.scheduler.rank_group.RankGroup``)."""

    failed: str | None

    def fail(self, message: str) -> None: ...


def _ignore(_: Event) -> None:
    """A follower's requests answer no client."""


class _Lockstep(EngineLoop):
    """What rank 0 and the followers run alike: the frozen clock, cancellations and holds, and the
    end-of-iteration check."""

    def _start_lockstep(self) -> None:
        self.tp: TensorParallel = self.engine.model.config.tensor_parallel
        self.clock = time.perf_counter()
        self.cancelled_now: frozenset[int] = frozenset()
        self.failures = self.digest = 0  # this iteration's failed requests and sum of sampled tokens (+1)

    def _now(self) -> float:
        return self.clock

    def _freeze(self, record: Iteration) -> None:
        self.clock, self.cancelled_now = record.clock, record.cancelled
        for pending in self.waiting:
            if isinstance(pending, Job) and not pending.admitted:
                pending.held_back = pending.serial in record.held

    def _drop_cancelled(self) -> None:
        for pending in [p for p in (*self.waiting, *self.running) if p.serial in self.cancelled_now]:
            self._drop(pending)

    def _fail(self, job: Job, err: Exception) -> None:
        self.failures += 1
        super()._fail(job, err)

    def _broke(self, pending: Pending, err: Exception) -> None:
        if isinstance(pending, WarmupTask):
            self.failures += 1
        super()._broke(pending, err)

    def _accept(self, job: Job, index: int, logits: torch.Tensor) -> None:
        super()._accept(job, index, logits)
        self.digest += job.sequences[index].output_ids[-1] + 1

    def _model_call(self, run: Any) -> Any:
        try:
            return run()
        except Exception as err:
            raise RanksOutOfStep(f"a pass through the model failed on tensor-parallel rank {self.tp.rank} "
                                 f"({type(err).__name__}: {err}); the ranks cannot go on in step") from err

    def _check(self) -> None:
        """The ranks agree on this iteration's failed requests and sampled tokens, or the group ends."""
        failures, digest, self.failures, self.digest = self.failures, self.digest, 0, 0
        if not same_on_every_rank([failures, digest], self.tp):
            raise RanksOutOfStep(f"the tensor-parallel ranks disagree on an iteration (rank {self.tp.rank}: "
                                 f"{failures} failed requests, token digest {digest}): they diverged")


class LeaderLoop(_Lockstep):
    """Rank 0's loop: as ``EngineLoop``, each iteration broadcast first. ``ranks``: the group it leads,
    told when it can no longer go on."""

    def __init__(self, engine: Any, mode: Any, ranks: Ranks, **options: Any) -> None:
        super().__init__(engine, mode, **options)
        self.ranks, self.serials = ranks, itertools.count()
        self._start_lockstep()

    @property
    def failure(self) -> str | None:
        return self.ranks.failed

    def sample_seed(self) -> int | None:
        return random.getrandbits(62)

    def call(self, run: Any) -> Any:
        raise HypicError("under tensor parallelism the engine loop runs only work every rank can repeat "
                         "(requests, warm-ups, flushes): peers' calls are not served")

    def flush(self, namespace: str | None, tiers: frozenset[str]) -> Any:
        command = FlushCommand(lambda: self.engine.flush(namespace, tiers), namespace=namespace, tiers=tiers)
        self.inbox.put(command)
        return command.future

    def _main(self) -> None:
        torch.set_grad_enabled(False)
        try:
            while self._lead():
                pass
        except RanksOutOfStep as err:
            self.ranks.fail(str(err))
        except Exception as err:  # mostly a rank gone (its collective failed): the watchdog names it first
            time.sleep(NAME_THE_RANK_S)
            self.ranks.fail(f"the engine loop failed ({type(err).__name__}: {err})")

    def _lead(self) -> bool:
        """One iteration: drain, broadcast what it took, run it; False once stopped."""
        for pending in self.waiting:
            if isinstance(pending, Job):
                pending.held_back = None  # live: whether the loop is idle
        idle = not self.running and all(isinstance(p, Job) and p.awaiting for p in self.waiting)
        items, stop = self._take_inbox(self._idle_wait() if idle else None)
        record = self._record(items, stop)
        from_rank_zero(record)
        if stop:
            return False
        self._freeze(record)
        self._iterate()
        self._check()
        return True

    def _take_inbox(self, wait_s: float | None) -> tuple[list[Item], bool]:
        """What the inbox holds (waiting up to ``wait_s`` for the first item), admitted or run here, as
        records; and whether the loop stops."""
        items: list[Item] = []
        for item in self._inbox_items(wait_s):
            if item is None:
                return items, True
            record = self._take(item)
            if record is not None:
                items.append(record)
        return items, False

    def _take(self, item: Pending | Command) -> Item | None:
        if isinstance(item, FlushCommand):
            self._run_command(item)
            return FlushRecord(item.namespace, item.tiers)
        if isinstance(item, Command):
            if item.run is not wake_only:
                item.future.set_exception(HypicError("not served under tensor parallelism"))
            return None
        if isinstance(item, WarmupTask) and item.source is None:  # a peer's steps: no other rank could make them
            with self._queued_lock:
                self._queued -= 1
            item.future.set_exception(HypicError("precombined or peer steps are not served under tensor parallelism"))
            return None
        item.serial = next(self.serials)
        self._admit(item)
        if isinstance(item, WarmupTask):
            assert item.source is not None
            return WarmupRecord(item.serial, item.source, item.remaining, item.start)
        return JobRecord(item.serial, item.rid, item.plan, item.request, item.sequences[0].seed, item.start,
                         item.footprint, item.remaining)

    def _record(self, items: list[Item], stop: bool) -> Iteration:
        """This iteration's record: ``items``, and the cancellations, holds and clock as of now."""
        if stop:
            return Iteration(items, frozenset(), frozenset(), 0.0, stop=True)
        now = time.monotonic()
        pendings = (*self.waiting, *self.running)
        cancelled = frozenset(p.serial for p in pendings if p.cancelled.is_set())
        held = frozenset(p.serial for p in self.waiting if isinstance(p, Job) and p.holds(now))
        return Iteration(items, cancelled, held, time.perf_counter())


class FollowerLoop(_Lockstep):
    """Rank 1..N-1's loop: runs, on this thread, the iterations rank 0 broadcasts until it stops."""

    def __init__(self, engine: Any, mode: Any, **options: Any) -> None:
        super().__init__(engine, mode, **options)
        self._start_lockstep()

    def run(self) -> None:
        torch.set_grad_enabled(False)
        while not (record := from_rank_zero()).stop:
            self._apply(record)
            self._freeze(record)
            self._iterate()
            self._check()

    def _apply(self, record: Iteration) -> None:
        for item in record.items:
            if isinstance(item, FlushRecord):
                self._flush(item)
            elif isinstance(item, JobRecord):
                job = self._job(item)
                self._admit(job)
                job.remaining = item.remaining  # rank 0's estimate (its lower tiers' index may differ)
            else:
                kind, documents, namespace = item.source
                steps = (self.engine.warmup_steps if kind == "warmup" else self.engine.build_steps)(
                    documents, self.mode, namespace)
                self._admit(WarmupTask(steps, item.remaining, start=item.start, serial=item.serial))

    def _flush(self, item: FlushRecord) -> None:
        try:
            self.engine.flush(item.namespace, item.tiers)
        except Exception as err:  # noqa: BLE001 - rank 0 reports its own outcome to the client
            log.warning("flush on rank %d failed (%s: %s)", self.tp.rank, type(err).__name__, err)

    def _job(self, record: JobRecord) -> Job:
        request, parts = record.request, record.plan.parts
        top = request.logprobs.top if request.logprobs is not None else None
        sequences = self.engine.sequences(request.params, parts.token_ids, top, seed=record.seed)
        return Job(record.rid, parts, request, self.mode, sequences, _ignore, record.plan, start=record.start,
                   footprint=record.footprint, serial=record.serial)

    def _wake_when_done(self, future: Any) -> None:
        """Nothing: a follower never waits on its inbox (rank 0 decides when loads count as done)."""

    def _publish(self) -> dict[str, Any]:
        return {}  # nobody reads a follower's counters
