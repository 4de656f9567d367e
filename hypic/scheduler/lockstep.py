"""The engine loop over N tensor-parallel ranks, in lockstep. Every rank runs the engine loop itself
(``EngineLoop``), its turns taken by this module's ``sync``: rank 0 (the server, ``LeaderSync``)
takes each turn's work from its inbox as one process would, then broadcasts an ``Iteration``: a
plain-data record of everything the iteration takes from outside the loop (what was drained from the
inbox, the requests cancelled, which requests still wait for their reads below memory). Every other
rank (``FollowerSync``) applies it and runs the same iteration on its own shard, so every rank makes
the same cache decisions and the same model calls in the same order.

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
from .loop import Command, EngineLoop, Event, FlushCommand, Job, Pending, WarmupTask, wake_only
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

    def run_iteration(self, loop: EngineLoop, record: Iteration) -> None:
        """The iteration ``record`` starts, between the ranks' two agreements: on what it starts from,
        and on its outcome."""
        self.freeze(record)
        self.agree_on_start(loop.waiting, loop.running)
        loop.iterate()
        self.check()


def _identity(item: Pending) -> Any:
    """What a request or a warm-up is, as plain data every rank derives alike from rank 0's record."""
    if isinstance(item, WarmupTask):
        return item.source
    plan = item.plan
    return (item.rid, tuple(plan.parts.token_ids), plan.spliced, sorted(plan.entry_keys.items()), plan.logits_from,
            item.request.params, [sequence.seed for sequence in item.sequences], item.footprint)


class LeaderSync(RankSync):
    """Rank 0's turns: drain the inbox, admit what it took, broadcast it with this turn's cancellations
    and holds as an ``Iteration``, then run the iteration between the ranks' agreements. ``ranks``:
    the group it leads, told when the loop can no longer go on."""

    def __init__(self, tp: TensorParallel, ranks: Ranks) -> None:
        super().__init__(tp)
        self.ranks = ranks

    def failure(self) -> str | None:
        return self.ranks.failed

    def sample_seed(self) -> int | None:
        return random.getrandbits(62)  # drawn here, sent in the request's record: every rank samples alike

    def before_end(self, err: BaseException) -> None:
        """A failure other than the ranks' disagreement is mostly a rank gone (its collective failed):
        the watchdog names it first."""
        if not isinstance(err, RanksOutOfStep):
            time.sleep(NAME_THE_RANK_S)

    def turn(self, loop: EngineLoop) -> bool:
        self.held = None  # live: whether the loop is idle
        items, stop = self._take_inbox(loop, loop.idle_wait())
        record = self._record(loop, items, stop)
        from_rank_zero(record)
        if stop:
            return False
        self.run_iteration(loop, record)
        return True

    def _take_inbox(self, loop: EngineLoop, wait_s: float | None) -> tuple[list[Item], bool]:
        """What the inbox holds (waiting up to ``wait_s`` for the first item), admitted or run here, as
        records; and whether the loop stops."""
        items: list[Item] = []
        for item in loop.inbox.items(wait_s):
            if item is None:
                return items, True
            record = self._take(loop, item)
            if record is not None:
                items.append(record)
        return items, False

    def _take(self, loop: EngineLoop, item: Pending | Command) -> Item | None:
        if isinstance(item, FlushCommand):
            return self._flush(loop, item)
        if isinstance(item, Command):
            if item.run is not wake_only:
                item.future.set_exception(HypicError("under tensor parallelism the engine loop runs only work every "
                                                     "rank can repeat (requests, warm-ups, flushes): peers' calls "
                                                     "are not served"))
            return None
        if isinstance(item, WarmupTask) and item.source is None:  # a peer's steps: no other rank could make them
            loop.inbox.gone()
            item.future.set_exception(HypicError("precombined or peer steps are not served under tensor parallelism"))
            return None
        loop.admit(item)
        if isinstance(item, WarmupTask):
            assert item.source is not None
            return WarmupRecord(item.serial, item.source, item.remaining, item.start)
        return JobRecord(item.serial, item.rid, item.plan, item.request, item.sequences[0].seed, item.start,
                         item.footprint, item.remaining)

    def _flush(self, loop: EngineLoop, command: FlushCommand) -> FlushRecord:
        """Every tier at once, here and (from the record) on every rank: the tiers below memory are not
        left to a thread of their own, whose end the other ranks could not see."""
        loop.run_command(Command(lambda: loop.engine.flush(command.namespace, command.tiers), command.flushed))
        command.future.set_result(None)
        if command.flushed.exception() is not None:  # the other ranks' flushes must fail too, or the group ends
            self.failed()
        return FlushRecord(command.namespace, command.tiers)

    def _record(self, loop: EngineLoop, items: list[Item], stop: bool) -> Iteration:
        """This iteration's record: ``items``, and the cancellations and holds as of now."""
        if stop:
            return Iteration(items, frozenset(), frozenset(), stop=True)
        now = time.monotonic()
        pendings = (*loop.waiting, *loop.running)
        cancelled = frozenset(p.serial for p in pendings if p.cancelled.is_set())
        held = frozenset(p.serial for p in loop.waiting if isinstance(p, Job) and p.holds(now))
        return Iteration(items, cancelled, held)


class FollowerSync(RankSync):
    """Rank 1..N-1's turns: each the iteration rank 0 broadcast, its items admitted here as rank 0
    admitted them, until rank 0 stops."""

    def turn(self, loop: EngineLoop) -> bool:
        record = from_rank_zero()
        if record.stop:
            return False
        for _ in loop.inbox.items(None):
            pass  # wake-ups only: rank 0 decides when a read below memory counts as done
        self._apply(loop, record)
        self.run_iteration(loop, record)
        return True

    def _apply(self, loop: EngineLoop, record: Iteration) -> None:
        for item in record.items:
            if isinstance(item, FlushRecord):
                self._flush(loop, item)
            elif isinstance(item, JobRecord):
                job = self._job(loop, item)
                loop.admit(job)
                job.remaining = item.remaining  # rank 0's estimate (its lower tiers' index may differ)
            else:
                kind, documents, namespace = item.source
                steps = (loop.engine.warmup_steps if kind == "warmup" else loop.engine.build_steps)(
                    documents, loop.mode, namespace)
                loop.admit(WarmupTask(steps, item.remaining, start=item.start, serial=item.serial, source=item.source))

    def _flush(self, loop: EngineLoop, item: FlushRecord) -> None:
        """Rank 0's flush here too; one that fails on some ranks only leaves their pools apart: the
        iteration's check ends the group then."""
        try:
            loop.engine.flush(item.namespace, item.tiers)
        except Exception as err:  # noqa: BLE001 - counted: every rank failed alike, or the group ends
            self.failed()
            log.error("flush on rank %d failed (%s: %s)", self.tp.rank, type(err).__name__, err)

    def _job(self, loop: EngineLoop, record: JobRecord) -> Job:
        request, parts = record.request, record.plan.parts
        top = request.logprobs.top if request.logprobs is not None else None
        sequences = loop.engine.sequences(request.params, parts.token_ids, top, seed=record.seed)
        return Job(record.rid, parts, request, loop.mode, sequences, _ignore, record.plan, start=record.start,
                   footprint=record.footprint, serial=record.serial)


def leader_loop(engine: Any, mode: Any, ranks: Ranks, **options: Any) -> EngineLoop:
    """Rank 0's engine loop (started like any): every turn broadcast to the other ranks first."""
    sync = LeaderSync(engine.model.config.tensor_parallel, ranks)
    return EngineLoop(engine, mode, sync=sync, on_fatal=ranks.fail, **options)


def follow_rank_zero(engine: Any, mode: Any, **options: Any) -> None:
    """Rank 1..N-1: run, on this thread, the iterations rank 0 broadcasts until it stops."""
    loop = EngineLoop(engine, mode, sync=FollowerSync(engine.model.config.tensor_parallel), **options)
    torch.set_grad_enabled(False)
    while loop.turn():
        pass
