"""A worker: one engine in its own process (run as a Ray actor by the router), scheduled by the
engine loop the server runs too (``hypic.scheduler.loop.EngineLoop``). Requests come planned: a
combine pass runs on the ``RequestPlan`` made where the request arrived, never on a plan of its own."""
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import torch

from hypic.assembler import Steps
from hypic.engine import Engine, GenerationResult, Prefill
from hypic.memory_trace import start_from_env
from hypic.cache.plan import RequestPlan
from hypic.prefill_stats import BuiltForRequest, PrefillStats
from hypic.cache.modes import Mode
from hypic.cache.store import SegmentEntry
from hypic.scheduler.loop import EngineLoop, default_prefill_batch

from .channel import BulkChannel, GroupSpec, Parcel
from .plan import SegmentJob
from .serialization import register_tensor_serializer
from .transfer import ReceiveCounts, entries_of, entry_check, install_entries, receive_all

Result = TypeVar("Result")


class LoopStalled(TimeoutError):
    """A worker's engine loop did not answer a call within the worker's timeout: the worker is stuck."""


def document_build_steps(engine: Engine, jobs: list[SegmentJob], mode: Mode,
                         keep: bool = True) -> Steps[list[SegmentEntry]]:
    """The jobs' entries, held or built (each build's combine passes asked of the loop that runs
    these steps): what a peer or a replica builds for another's request. ``keep=False``: what is
    built is shipped only, not stored here too."""
    entries = []
    for job in jobs:
        policy = engine.policy(mode, job.namespace)
        entry, found = engine.cache.lookup_document(job.token_ids, policy)
        if found != job.key:
            raise ValueError(f"job key {job.key[:12]} does not address its tokens on this engine")
        if entry is None:
            entry = yield from engine.prefiller.document_steps(job.key, job.token_ids, policy, keep)
        entries.append(entry)
    return entries


class Worker:
    """Builds document interiors for peers, installs theirs (checked), and runs combine passes.
    Ray calls its methods concurrently (a threaded actor); all engine work goes through one
    ``EngineLoop``, the server's scheduler: builds and combine passes in chunks, builds by their
    request's uncached tokens (``priority``), combine passes before them (a short request's
    documents overtake a long one's between its chunks); installs, lookups and flushes run between
    chunks. Shipping entries to peers happens on the caller's thread, off the loop. A call waits on
    the loop ``timeout_s`` at most (the pool sets it past its own deadline, by which it has given
    up on this worker and killed it: this only keeps a call from waiting forever)."""

    def __init__(self, model: str, threads: int | None = None, options: dict[str, Any] | None = None,
                 timeout_s: float | None = None) -> None:
        register_tensor_serializer()
        self.timeout_s = timeout_s
        start_from_env()
        if threads is not None:
            torch.set_num_threads(threads)
        self.engine = Engine.from_pretrained(model, **(options or {}))
        self.rejected_entries = 0
        self.loop = EngineLoop(self.engine, Mode.HYPIC, max_prefill_batch=default_prefill_batch(str(self.engine.model.device)))
        self.loop.start()
        self.channel: BulkChannel | None = None  # bulk transfer to the other workers (None: Ray's object store)
        self.received = ReceiveCounts()

    def join_group(self, spec: GroupSpec, rank: int) -> int:
        """Become rank ``rank`` of a new bulk-transfer group (returns when every member has joined)."""
        old, self.channel = self.channel, BulkChannel(spec, rank)
        if old is not None:
            old.close()
        return spec.generation

    def fingerprint(self) -> str:
        return self.engine.fingerprint

    def build(self, jobs: list[SegmentJob], mode: Mode, priority: float = 0,
              ship_to: tuple[int, int] | None = None) -> list[SegmentEntry | Parcel]:
        """Each job's document prefilled alone unless this worker already holds it; the entries
        stay in this worker's public pool (when they fit) and go back to the caller, or, with
        ``ship_to`` = (rank, generation) of a live group, their bytes go there and parcels come
        back. ``priority``: the tokens the request still needs built (fewer go first)."""
        return self.ship(self._wait(self.loop.run_steps(self._build_steps(jobs, mode), priority)), ship_to)

    def ship(self, entries: list[SegmentEntry], ship_to: tuple[int, int] | None) -> list[SegmentEntry | Parcel]:
        """``entries`` sent point-to-point to ``ship_to`` (parcels back), or themselves when there is
        no such group here (they go through Ray's object store)."""
        channel = self.channel
        if ship_to is None or channel is None or channel.broken or channel.generation != ship_to[1]:
            return list(entries)
        return channel.ship(entries, ship_to[0])

    def _build_steps(self, jobs: list[SegmentJob], mode: Mode) -> Steps[list[SegmentEntry]]:
        return document_build_steps(self.engine, jobs, mode)

    def cache(self, jobs: list[SegmentJob], mode: Mode, priority: float = 0) -> list[str]:
        """``build`` for a warm-up: the entries stay here; only their keys go back."""
        return [entry.key for entry in self.build(jobs, mode, priority)]

    def fetch(self, keys: list[str], ship_to: tuple[int, int] | None = None) -> list[SegmentEntry | Parcel]:
        """The entries of ``keys`` this worker still holds (evicted ones are left out), shipped as ``build``'s."""
        held = self._on_loop(lambda: self.engine.cache.held_documents(keys))
        return self.ship(held, ship_to)

    def install(self, mode: Mode, *batches: list[SegmentEntry | Parcel]) -> ReceiveCounts:
        """Receive, check and store peers' entries (each batch: one peer's list); returns how they
        came. An entry that fails its check or does not arrive is dropped (and counted): the
        combine pass recomputes it."""
        check = entry_check(self.engine.fingerprint, self.engine.policy(mode).role, self.engine.model.config)
        entries, counts = receive_all(self.channel, entries_of(list(batches)), check)

        def install() -> ReceiveCounts:
            refused = install_entries(self.engine, entries, mode)[1]
            self.rejected_entries += refused + counts.failed
            self.received.add(counts)
            return counts

        return self._on_loop(install)

    def receive_counts(self) -> ReceiveCounts:
        """Entries received as combine node, by path (point-to-point, object store) and failed."""
        return self.received

    def rejected(self) -> int:
        """How many received entries failed their check."""
        return self.rejected_entries

    def prefill(self, plan: RequestPlan, built: BuiltForRequest = BuiltForRequest()) -> Prefill:
        """The combine pass of the request ``plan`` (this worker is its combine node); the caller
        decodes the state. ``built``: what was computed for the request beforehand (its stats count
        it as computed)."""
        return self._wait(self.loop.run_steps(self.engine.prefiller.prefill_steps(plan))).for_request(built)

    def precombine(self, plan: RequestPlan, built: BuiltForRequest = BuiltForRequest(),
                   arriving: frozenset[str] = frozenset()) -> PrefillStats | None:
        """Combine the head of the request this worker already holds (``Engine.precombine_steps``; the
        documents keyed in ``arriving`` left out), while its peers' last documents are on their
        way; the head's stats (None: nothing combined)."""
        return self._wait(self.loop.run_steps(self.engine.prefiller.precombine_steps(plan, built, arriving)))

    def generate(self, plan: RequestPlan, sampling: dict[str, Any],
                 built: BuiltForRequest = BuiltForRequest()) -> GenerationResult:
        """The request ``plan`` prefilled and decoded here (one continuation)."""
        return self._wait(self.loop.run_steps(self.engine.generate_plan_steps(plan, built, **sampling)))

    def flush(self, namespace: str | None = None) -> int:
        """Drop every cached entry and request state (of cache ``namespace`` only, if given);
        returns the entries dropped."""
        return self._on_loop(lambda: self.engine.flush(namespace)[0])

    def held(self) -> list[str]:
        """Every key in this worker's public pool (the router's index syncs on it)."""
        return self._on_loop(lambda: list(self.engine.cache.document_keys()))

    def _on_loop(self, run: Callable[[], Result]) -> Result:
        """``run`` on the loop thread between chunks (one thread owns the engine); its result or error."""
        return self._wait(self.loop.call(run))

    def _wait(self, future: Future[Result]) -> Result:
        """``future``'s result, waited for ``timeout_s`` at most (then ``LoopStalled``: the caller
        treats this worker as lost)."""
        if not wait([future], self.timeout_s)[0]:
            raise LoopStalled(f"the worker's engine loop did not answer within {self.timeout_s:g} s")
        return future.result(timeout=0)  # done: the wait above saw it
