"""The engine loop over N tensor-parallel ranks, in lockstep. Rank 0 (the server) runs the loop as one
process would, except that every iteration starts by broadcasting an ``Iteration``: a plain-data
record of everything the iteration takes from outside the loop (what was drained from the inbox,
the requests cancelled, which requests still wait for their reads below memory). Every
other rank (``FollowerLoop``) applies it and runs the same iteration on its own shard, so every rank
makes the same cache decisions and the same model calls in the same order.

The ranks check that they are in step before they could fall out of it (each in one small
all-reduce, ``RankSync``): before an iteration, on the requests it starts from (each one's identity,
tokens left, admission, in order); before each pass through the model, on its batch; after the
iteration, on what failed and an ordered digest of the tokens sampled. A disagreement, a pass that
fails on one rank (its peers would wait in a collective it never reaches) or a collective that fails
ends the group (``RanksOutOfStep``, a ``GroupFailure``) in seconds, not at gloo's timeout."""
import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import xxhash

from ..cache.plan import RequestPlan
from ..errors import HypicError
from ..parallel.group import GroupFailure, TensorParallel, from_rank_zero, same_on_every_rank
from .loop import Command, EngineLoop, Event, Job, Pending, WarmupTask, wake_only
from .sync import Solo
from .requests import Request

log = logging.getLogger("hypic.server")
NAME_THE_RANK_S = 1.5  # a failed collective waits this long for the watchdog to name the rank that died


HASH_MODULUS = (1 << 61) - 1  # a prime: the ordered hash stays below 2**61
HASH_BASE = 1_000_003


class RanksOutOfStep(GroupFailure):
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
    ``held``: serials of waiting requests still held back for their reads below memory; ``stop``: the
    server stops."""

    items: list[Item]
    cancelled: frozenset[int]
    held: frozenset[int]
    stop: bool = False




@dataclass
class FlushCommand(Command):
    """A flush, named so that the other ranks make it too (closures cannot be sent)."""

    namespace: str | None = None
    tiers: frozenset[str] = frozenset()


class Ranks(Protocol):
    """The group rank 0 leads (``hypic.parallel.ranks.RankGroup``)."""

    failed: str | None

    def fail(self, message: str) -> None: ...


def _ignore(_: Event) -> None:
    """A follower's requests answer no client."""


def ordered_hash(values: Iterable[int], start: int = 0) -> int:
    """A hash of ``values`` in order (swapping two changes it), the same in every process: 61 bits, so
    that it travels in an int64 all-reduce."""
    digest = start
    for value in values:
        digest = (digest * HASH_BASE + value + 1) % HASH_MODULUS
    return digest


def stable_hash(value: Any) -> int:
    """A hash of a plain-data value's ``repr`` that every process computes alike (``hash`` is salted)."""
    return xxhash.xxh3_64_intdigest(repr(value).encode()) % HASH_MODULUS


class RankSync(Solo):
    """How a rank's loop stays in step with the others. Before an iteration the ranks agree on the requests
    it starts from (each one's serial, identity, tokens left and admission, in order); before each pass
    through the model on its batch (serials and sizes, in order), so none enters a collective its peers
    skip; after the iteration on what failed and what each sample took (an ordered digest). What the
    loop reads from outside is rank 0's, from the iteration's record. A disagreement, or a pass that
    fails on one rank, ends the group (``RanksOutOfStep``)."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.failures = self.digest = 0  # this iteration's failed requests and warm-ups, and sampled tokens
        self.digests: dict[int, int] = {}  # serial -> what each waiting request or warm-up is, hashed
        self.cancelled_now: frozenset[int] = frozenset()
        self.held: frozenset[int] | None = None  # the requests rank 0 holds back this iteration (None: live)

    def model_call(self, run: Callable[[], Any], batch: list[int]) -> Any:
        self.agree("a batch", [ordered_hash(batch), len(batch)])
        try:
            return run()
        except Exception as err:
            raise RanksOutOfStep(f"a pass through the model failed on tensor-parallel rank {self.tp.rank} "
                                 f"({type(err).__name__}: {err}); the ranks cannot go on in step") from err

    def failed(self) -> None:
        self.failures += 1

    def sampled(self, serial: int, index: int, token: int) -> None:
        self.digest = ordered_hash((serial, index, token), self.digest)

    def admitted(self, item: Pending) -> None:
        self.digests[item.serial] = stable_hash(_identity(item))

    def left(self, item: Pending) -> None:
        self.digests.pop(item.serial, None)

    def cancelled(self, pending: Pending) -> bool:
        return pending.serial in self.cancelled_now

    def held_back(self, job: Job) -> bool:
        """Rank 0's decision for this iteration, as its record says (live: this rank's own)."""
        if self.held is None:
            return super().held_back(job)
        return not job.admitted and job.serial in self.held

    def freeze(self, record: Iteration) -> None:
        """What the loop reads from outside during this iteration: rank 0's, from ``record``."""
        self.cancelled_now, self.held = record.cancelled, record.held

    def agree_on_start(self, waiting: list[Pending], running: list[Job]) -> None:
        self.agree("the iteration's requests", [ordered_hash(self._fingerprint(waiting, running))])

    def _fingerprint(self, waiting: list[Pending], running: list[Job]) -> Iterator[int]:
        for pending in waiting:
            left = int(pending.remaining) if math.isfinite(pending.remaining) else -1
            admitted = isinstance(pending, Job) and pending.admitted
            yield from (pending.serial, self.digests.get(pending.serial, 0), left, admitted)
        for job in running:
            yield from (job.serial, sum(not s.finished for s in job.sequences))

    def agree(self, what: str, values: list[int]) -> None:
        """Every rank holds the same ``values`` for ``what``, or the group ends."""
        if not same_on_every_rank(values, self.tp, what):
            raise RanksOutOfStep(f"the tensor-parallel ranks disagree on {what} (rank {self.tp.rank}: {values}): "
                                 "they diverged")

    def check(self) -> None:
        """The ranks agree on this iteration's failures and sampled tokens, or the group ends."""
        failures, digest, self.failures, self.digest = self.failures, self.digest, 0, 0
        self.agree("an iteration's outcome (failed requests, token digest)", [failures, digest])


class _Lockstep(EngineLoop):
    """The engine loop with a ``RankSync``: each iteration runs between the ranks' agreements."""

    def __init__(self, engine: Any, mode: Any, **options: Any) -> None:
        self.rank_sync = RankSync(engine.model.config.tensor_parallel)
        super().__init__(engine, mode, sync=self.rank_sync, **options)
        self.tp: TensorParallel = self.rank_sync.tp

    def _run_iteration(self, record: Iteration) -> None:
        """The iteration ``record`` starts, between the ranks' two agreements: on what it starts from,
        and on its outcome."""
        self.rank_sync.freeze(record)
        self.rank_sync.agree_on_start(self.waiting, self.running)
        self._iterate()
        self.rank_sync.check()


def _identity(item: Pending) -> Any:
    """What a request or a warm-up is, as plain data every rank derives alike from rank 0's record."""
    if isinstance(item, WarmupTask):
        return item.source
    plan = item.plan
    return (item.rid, tuple(plan.parts.token_ids), plan.spliced, sorted(plan.entry_keys.items()), plan.logits_from,
            item.request.params, [sequence.seed for sequence in item.sequences], item.footprint)


class LeaderLoop(_Lockstep):
    """Rank 0's loop: as ``EngineLoop``, each iteration broadcast first. ``ranks``: the group it leads,
    told when it can no longer go on."""

    def __init__(self, engine: Any, mode: Any, ranks: Ranks, **options: Any) -> None:
        super().__init__(engine, mode, on_fatal=ranks.fail, **options)
        self.ranks = ranks

    @property
    def failure(self) -> str | None:
        return self.ranks.failed or self.inbox.stopped

    def sample_seed(self) -> int | None:
        return random.getrandbits(62)

    def call(self, run: Any) -> Any:
        raise HypicError("under tensor parallelism the engine loop runs only work every rank can repeat "
                         "(requests, warm-ups, flushes): peers' calls are not served")

    def flush(self, namespace: str | None, tiers: frozenset[str]) -> Any:
        command = FlushCommand(lambda: self.engine.flush(namespace, tiers), namespace=namespace, tiers=tiers)
        self.inbox.command(command)
        return command.future

    def _die(self, err: BaseException) -> None:
        """The group ends; a failure other than the ranks' disagreement is mostly a rank gone (its
        collective failed): the watchdog names it first."""
        if not isinstance(err, RanksOutOfStep):
            time.sleep(NAME_THE_RANK_S)
        super()._die(err)

    def _turn(self) -> bool:
        """One iteration: drain, broadcast what it took, run it; False once stopped."""
        self.rank_sync.held = None  # live: whether the loop is idle
        items, stop = self._take_inbox(self._idle_wait() if self._idle() else None)
        record = self._record(items, stop)
        from_rank_zero(record)
        if stop:
            return False
        self._run_iteration(record)
        return True

    def _take_inbox(self, wait_s: float | None) -> tuple[list[Item], bool]:
        """What the inbox holds (waiting up to ``wait_s`` for the first item), admitted or run here, as
        records; and whether the loop stops."""
        items: list[Item] = []
        for item in self.inbox.items(wait_s):
            if item is None:
                return items, True
            record = self._take(item)
            if record is not None:
                items.append(record)
        return items, False

    def _take(self, item: Pending | Command) -> Item | None:
        if isinstance(item, FlushCommand):
            self._run_command(item)
            if item.future.exception() is not None:  # the other ranks' flushes must fail too, or the group ends
                self.rank_sync.failed()
            return FlushRecord(item.namespace, item.tiers)
        if isinstance(item, Command):
            if item.run is not wake_only:
                item.future.set_exception(HypicError("not served under tensor parallelism"))
            return None
        if isinstance(item, WarmupTask) and item.source is None:  # a peer's steps: no other rank could make them
            self.inbox.gone()
            item.future.set_exception(HypicError("precombined or peer steps are not served under tensor parallelism"))
            return None
        self._admit(item)
        if isinstance(item, WarmupTask):
            assert item.source is not None
            return WarmupRecord(item.serial, item.source, item.remaining, item.start)
        return JobRecord(item.serial, item.rid, item.plan, item.request, item.sequences[0].seed, item.start,
                         item.footprint, item.remaining)

    def _record(self, items: list[Item], stop: bool) -> Iteration:
        """This iteration's record: ``items``, and the cancellations and holds as of now."""
        if stop:
            return Iteration(items, frozenset(), frozenset(), stop=True)
        now = time.monotonic()
        pendings = (*self.waiting, *self.running)
        cancelled = frozenset(p.serial for p in pendings if p.cancelled.is_set())
        held = frozenset(p.serial for p in self.waiting if isinstance(p, Job) and p.holds(now))
        return Iteration(items, cancelled, held)


class FollowerLoop(_Lockstep):
    """Rank 1..N-1's loop: runs, on this thread, the iterations rank 0 broadcasts until it stops."""

    def run(self) -> None:
        torch.set_grad_enabled(False)
        while not (record := from_rank_zero()).stop:
            self._apply(record)
            self._run_iteration(record)

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
                self._admit(WarmupTask(steps, item.remaining, start=item.start, serial=item.serial,
                                       source=item.source))

    def _flush(self, item: FlushRecord) -> None:
        """Rank 0's flush here too; one that fails on some ranks only leaves their pools apart: the
        iteration's check ends the group then."""
        try:
            self.engine.flush(item.namespace, item.tiers)
        except Exception as err:  # noqa: BLE001 - counted: every rank failed alike, or the group ends
            self.rank_sync.failed()
            log.error("flush on rank %d failed (%s: %s)", self.tp.rank, type(err).__name__, err)

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
