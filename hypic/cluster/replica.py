"""One replica of a replicated service: a whole instance (engine, loop, pools, tiers; with
``--tp-size`` a lockstep group of ranks) that runs requests planned at the ingress and streams what
documents it holds to each ingress that follows it (``holdings``)."""
import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from ..cache.plan import RequestPlan
from ..cache.segments import PromptParts
from ..cache.store import SegmentEntry
from ..prefill_stats import BuiltForRequest
from ..router.plan import SegmentJob
from ..router.serialization import register_tensor_serializer
from ..router.transfer import install_entries, keep_copies, lend_entries
from ..cache.hybrid_cache import LENT_TIER
from ..router.worker import document_build_steps
from ..scheduler.jobs import PeerWork
from ..scheduler.loop import DoneEvent, ErrorEvent, Event, ProgressEvent
from ..server.protocol import GenerationRequest
from ..state import RequestState
from .holdings import HoldingsMark, holdings_of
from .index import Announcement
from .logs import relay_logs

log = logging.getLogger("hypic.cluster")
LOOP_CHECK_S = 1.0  # how often a request waiting for its next event looks whether the loop still runs
KEEPALIVE_S = 2.0  # a request's stream says it is still at work after this long without a message
# the longest a request waits for a prompt head another replica sends before computing it itself: a copy
# is taken between that replica's passes, so this is a pass or two
PREFIX_WAIT_S = 5.0


@dataclass(frozen=True)
class Mark:
    """A message on a request's stream that is not one of its events: ``PREFILLED`` (its first token
    is out: its prefill load leaves the replica, its TTFT is read at the ingress) or ``ALIVE`` (still
    at work: the ingress's deadline on the stream's silence starts again)."""

    what: str


PREFILLED, ALIVE = Mark("prefilled"), Mark("alive")


@dataclass(frozen=True)
class ReplicaWork:
    """A request as the ingress checked and planned it: the replica runs it as it is, re-planning
    nothing. ``waited_s``: how long it was at the ingress (its TTFT counts from its arrival there)."""

    rid: str
    parts: PromptParts
    request: GenerationRequest
    plan: RequestPlan
    waited_s: float = 0.0


@dataclass(frozen=True)
class RemoteBuilds:
    """Documents other replicas build for a request, or fetch it from their pools: each call's Ray
    object reference (a ``list[SegmentEntry]``), held inside this record so that Ray Serve delivers
    the request's call at once instead of waiting for them; ``timeout_s``: how long the replica waits
    for them before it builds them itself."""

    refs: tuple[Any, ...]
    remote: tuple[tuple[str, int], ...]  # (key, tokens) of each document built elsewhere
    timeout_s: float
    fetched: tuple[str, ...] = ()  # of the entries the calls return, those another replica held: lent, not built
    prefix: Any = None  # a call's reference to the head of the prompt another replica's private pool holds

    @property
    def keys(self) -> frozenset[str]:
        """The documents built elsewhere."""
        return frozenset(key for key, _ in self.remote)


def told(events: list[Event], streamed: bool) -> list[Event]:
    """What of ``events`` the ingress needs: of a run of progress, each sample's latest (its client
    is sent what is new since the last one it got); none at all for a request that is not streamed."""
    out: list[Event] = []
    latest: dict[int, Event] = {}
    for event in events:
        if isinstance(event, ProgressEvent):
            latest[event.index] = event
            continue
        out += latest.values() if streamed else []
        latest = {}
        out.append(event)
    return out + (list(latest.values()) if streamed else [])


class Replica:
    """The replica deployment's body. ``start_instance(args)`` builds the instance as ``hypic
    serve ARGS`` would (its loop started); ``replica``: this replica's id (Ray Serve's); ``logs``:
    the queue its log lines go to (``hypic.cluster.logs``; None: its own log files only)."""

    def __init__(self, args: Any, start_instance: Callable[[Any], Any], replica: str | None = None,
                 logs: Any = None) -> None:
        relay_logs(logs, "replica", args.log_level)  # its warnings reach `hypic serve`'s output
        register_tensor_serializer()  # entries between replicas travel as numpy arrays, not pickled tensors
        self.instance = start_instance(args)
        self.replica = replica or _serve_replica_id()
        self.holdings_log = holdings_of(self.instance.engine.cache, self.replica)
        self.started = time.time()
        self.weight_bytes = self.instance.engine.weight_bytes()  # reported with every status: counted once
        # documents fetched from other replicas' pools for requests here: how many, their bytes, and how
        # long their requests waited for the other replicas' entries
        self.fetches = {"fetched_documents": 0, "fetched_bytes": 0, "fetched_tokens": 0, "fetched_prefixes": 0,
                        "fetched_prefix_tokens": 0, "fetch_wait_seconds": 0.0,
                        "copied_documents": 0}

    async def run(self, route: Any, work: ReplicaWork,
                  builds: RemoteBuilds | None = None) -> AsyncIterator[Event | HoldingsMark | Mark]:
        """The request's events, as its loop emits them, and just before the last of them how far
        its holdings stream has come (``HoldingsMark``); ``PREFILLED`` before the first event of a
        request that is not streamed (a streamed one's first progress says it), ``ALIVE`` after
        ``KEEPALIVE_S`` without a message. ``route`` is for the router (which replica); the replica
        ignores it. ``builds``: documents other
        replicas build for it meanwhile, stored here (checked) as they arrive while this replica
        builds the rest itself."""
        job, running, lent = self._job(work), asyncio.get_running_loop(), []
        peer_work = self._peer_work(builds, running, lent) if builds is not None else None
        events: asyncio.Queue[Event] = asyncio.Queue()
        self.instance.loop.enqueue(job, lambda event: running.call_soon_threadsafe(events.put_nowait, event),
                                   peer_work)
        prefill_told = work.request.stream
        try:
            while True:
                arrived = await self._batch(events)
                if not arrived:
                    yield ALIVE
                    continue
                if not prefill_told and isinstance(arrived[0], ProgressEvent):
                    prefill_told = True
                    yield PREFILLED
                batch = told(arrived, work.request.stream)
                ended = bool(batch) and isinstance(batch[-1], (DoneEvent, ErrorEvent))
                if ended:  # what it holds now reaches the index before its client hears the end
                    yield self.holdings_log.mark()
                if batch:  # a request that is not streamed is told nothing per token: no message at all
                    yield [self._stamped(event) for event in batch]
                if ended:
                    break
        finally:
            job.cancel()  # no-op once finished; a client that left stops the work here
            if builds is not None and builds.fetched:  # what was lent to it goes back: after the loan, which
                # the loop ran first if it ran at all (its commands run in order), so ``lent`` is read then
                self.instance.loop.call(lambda: self.instance.engine.cache.return_documents(lent))

    async def _batch(self, events: asyncio.Queue[Event]) -> list[Event]:
        """The next event and every one already queued behind it (a slow reader gets them in one
        message, not one each); none if ``KEEPALIVE_S`` passed without one."""
        first = await self._next(events, KEEPALIVE_S)
        if first is None:
            return []
        batch = [first]
        while not events.empty() and not isinstance(batch[-1], (DoneEvent, ErrorEvent)):
            batch.append(events.get_nowait())
        return batch

    async def build(self, route: Any, jobs: list[SegmentJob]) -> list[SegmentEntry]:
        """Documents for another replica's request: each held here or built among this replica's
        other work. What is built is not kept here: the replica serving the request stores it, and a
        copy here would fill this pool with documents its own requests do not ask for."""
        loop = self.instance.loop
        steps = document_build_steps(self.instance.engine, jobs, loop.mode, keep=False)
        return await asyncio.wrap_future(loop.run_steps(steps, sum(len(job.token_ids) for job in jobs)))

    async def keep_copies(self, route: Any, entries: list[SegmentEntry]) -> list[str]:
        """Copies of hot documents another replica holds, made ahead of need: each checked and kept
        where it fits beside what this pool holds (``keep_copies``); the keys kept."""
        engine, loop = self.instance.engine, self.instance.loop
        kept = await asyncio.wrap_future(loop.call(lambda: keep_copies(engine, entries, loop.mode)))
        self.fetches["copied_documents"] += len(kept)
        return kept

    async def lend_prefix(self, route: Any, plan: RequestPlan) -> RequestState | None:
        """For another replica's request: a copy of the longest head of ``plan``'s prompt this
        replica's private pool holds (None: none), taken between the loop's passes."""
        cache = self.instance.engine.cache
        return await asyncio.wrap_future(self.instance.loop.call(lambda: cache.lend_prefix(plan)))

    async def _take_prefix(self, plan: RequestPlan, sent: Any, timeout_s: float) -> None:
        """The head of ``plan``'s prompt another replica sends, kept in the private pool before the
        request's prefill starts (it is the request's peer work), so that it resumes from it; one
        that does not come within ``timeout_s``, or is refused, is computed by the prefill instead."""
        start, cache = time.perf_counter(), self.instance.engine.cache
        try:
            state = await asyncio.wait_for(sent, timeout_s)
            kept = 0 if state is None else await asyncio.wrap_future(
                self.instance.loop.call(lambda: cache.install_prefix(plan, state)))
        except Exception as err:  # noqa: BLE001 - the request computes the head itself
            why = f"not within {timeout_s:g} s" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
            log.warning("a prompt head from another replica was not taken (%s); the request computes it", why)
            return
        if kept:
            self.fetches["fetched_prefixes"] += 1
            self.fetches["fetched_prefix_tokens"] += kept
            self.fetches["fetched_tokens"] += kept
            self.fetches["fetch_wait_seconds"] += time.perf_counter() - start

    def _peer_work(self, builds: RemoteBuilds, running: asyncio.AbstractEventLoop, lent: list[str]) -> PeerWork:
        """The request's peer work, started by the loop once the request holds its room: this
        replica's own cold documents built on the loop while the others' entries are awaited here;
        its outcome, once both are in, what the prefill is told was built for it. The keys of the
        fetched documents lent to it (not kept in the pool) go to ``lent``."""

        def start(plan: RequestPlan) -> Future:  # on the loop's thread
            outcome: Future = Future()
            own = self._own_builds(plan, builds.keys | set(builds.fetched))
            asyncio.run_coroutine_threadsafe(self._received(plan, builds, own, outcome, lent), running)
            return outcome

        return start

    def _own_builds(self, plan: RequestPlan, elsewhere: frozenset[str]) -> tuple[frozenset[str], Future]:
        """The request's documents no tier here holds and no other replica builds, queued on the loop
        to be built (and kept) here; their keys, and the future of their builds."""
        engine, loop, namespace = self.instance.engine, self.instance.loop, plan.parts.namespace
        held, jobs = engine.cache.document_keys(), {}
        for _, key, token_ids in plan.documents():
            if key not in elsewhere and key not in held and not engine.cache.lower_tiers_of(key, namespace):
                jobs.setdefault(key, SegmentJob(key, token_ids, namespace))
        if not jobs:
            done: Future = Future()
            done.set_result([])
            return frozenset(), done
        steps = document_build_steps(engine, list(jobs.values()), loop.mode)
        return frozenset(jobs), loop.run_steps(steps, sum(len(job.token_ids) for job in jobs.values()))

    async def _received(self, plan: RequestPlan, builds: RemoteBuilds, own: tuple[frozenset[str], Future],
                        outcome: Future, lent: list[str]) -> None:
        """Off the loop, within ``builds.timeout_s``: the other replicas' entries received and stored
        (checked; a refused one is recomputed), and this replica's own builds done: ``outcome`` holds
        what was built for the request. On a failure or the deadline it fails instead, and the
        request's prefill builds here whatever it still misses."""
        try:
            await asyncio.wait_for(self._all_built(plan, builds, own[1], lent), builds.timeout_s)
        except Exception as err:  # noqa: BLE001 - what is missing is built by the request's prefill
            why = f"not within {builds.timeout_s:.0f} s" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
            log.warning("a request's documents from other replicas did not all come (%s); its prefill builds what "
                        "it misses", why)
            outcome.set_exception(err)
            return
        fetched = tuple((key, LENT_TIER) for key in builds.fetched)
        outcome.set_result((None, BuiltForRequest(own[0] | builds.keys, builds.remote, loaded=fetched)))

    async def _all_built(self, plan: RequestPlan, builds: RemoteBuilds, own: Future, lent: list[str]) -> None:
        """The other replicas' entries received and stored (checked) or, those fetched from another's
        pool, lent to the request (kept only where there is room: ``lend_document``), the prompt's
        head another replica sends kept (``_take_prefix``), and this replica's own builds done. The
        caller's deadline covers them all: a build still running here when it passes is not repeated
        by the request's prefill, which waits for it (``Prefiller``)."""
        engine, loop, start = self.instance.engine, self.instance.loop, time.perf_counter()
        head = None if builds.prefix is None else asyncio.ensure_future(
            self._take_prefix(plan, builds.prefix, min(builds.timeout_s, PREFIX_WAIT_S)))
        batches = await asyncio.gather(*builds.refs)
        entries = [entry for batch in batches for entry in batch]
        fetched = set(builds.fetched)
        built, copies = [e for e in entries if e.key not in fetched], [e for e in entries if e.key in fetched]
        if copies:
            self.fetches["fetched_documents"] += len(copies)
            self.fetches["fetched_bytes"] += sum(entry.nbytes for entry in copies)
            self.fetches["fetched_tokens"] += sum(len(entry.token_ids) for entry in copies)
            self.fetches["fetch_wait_seconds"] += time.perf_counter() - start
        await asyncio.wrap_future(loop.call(lambda: install_entries(engine, built, loop.mode)))
        # the loan is recorded on the loop, so it is returned even if this wait is cut short meanwhile
        await asyncio.wrap_future(loop.call(lambda: lent.extend(lend_entries(engine, copies, loop.mode))))
        await asyncio.wrap_future(own)
        if head is not None:
            await head

    def _job(self, work: ReplicaWork) -> Any:
        loop, request = self.instance.loop, work.request
        top = request.logprobs.top if request.logprobs is not None else None
        sequences = self.instance.engine.sequences(request.params, list(work.parts.token_ids), top,
                                                   seed=loop.sample_seed())
        job = loop.job_for(work.parts, request, sequences, work.plan)
        job.rid, job.start = work.rid, time.perf_counter() - work.waited_s
        return job

    async def _next(self, events: asyncio.Queue[Event], within_s: float) -> Event | None:
        """The next event, an error if the loop stopped, or None after ``within_s``."""
        loop, deadline = self.instance.loop, time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                return await asyncio.wait_for(events.get(), timeout=min(LOOP_CHECK_S, within_s))
            except TimeoutError:
                if not loop.alive or loop.failure is not None:
                    return ErrorEvent(loop.failure or "the engine loop has stopped")
        return None

    def _stamped(self, event: Event) -> Event:
        if isinstance(event, (ProgressEvent, DoneEvent)):
            return replace(event, completion=replace(event.completion, replica=self.replica))
        return event

    async def warmup(self, route: Any, documents: list[str], namespace: str) -> tuple[list[int], HoldingsMark]:
        """Cache ``documents`` here; their token counts, and how far the holdings stream has come."""
        future = await asyncio.to_thread(self.instance.loop.warmup, documents, namespace)
        counts = await asyncio.wrap_future(future)
        return counts, self.holdings_log.mark()

    async def flush(self, route: Any, namespace: str | None, tiers: frozenset[str]) -> tuple[Any, HoldingsMark]:
        flushed = await asyncio.wrap_future(self.instance.loop.flush(namespace, tiers))
        if "memory" in tiers:
            self.holdings_log.cleared(namespace)  # its private pool's prefixes went too
        return flushed, self.holdings_log.mark()

    async def holdings(self, route: Any, after: tuple[str, int] | None) -> AsyncIterator[Announcement]:
        """This replica's holdings stream for one follower, from ``after`` (incarnation, seq; None:
        from a dump of all it holds)."""
        async for told in self.holdings_log.follow(after):
            yield told

    async def status(self, route: Any) -> dict[str, Any]:
        """Who this replica is and how busy: what ``/get_server_info`` lists per replica and
        ``/metrics`` sums."""
        loop, cache = self.instance.loop, self.instance.engine.cache
        pools = cache.describe()
        return {"replica": self.replica, "pid": os.getpid(), "node": socket.gethostname(), "node_ip": _node_ip(),
                "node_id": _node_id(), "chunk_tokens": self.instance.engine.chunk_tokens,
                "counters": {**loop.snapshot, **self.fetches}, "documents_held": len(cache.document_keys()),
                "public_pool_bytes": pools["public_pool"]["bytes"],
                "public_pool_budget_bytes": pools["public_pool"]["budget_bytes"], "public_pool_fill": cache.public_fill(),
                "private_pool_bytes": pools["private_pool"]["bytes"], "weight_bytes": self.weight_bytes,
                "uptime_s": time.time() - self.started, "healthy": loop.alive and loop.failure is None}

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose loop stopped is restarted."""
        loop = self.instance.loop
        if not loop.alive or loop.failure is not None:
            raise RuntimeError(loop.failure or "the engine loop has stopped")

    def __del__(self) -> None:
        instance = getattr(self, "instance", None)
        if instance is not None:
            instance.close()


def _serve_replica_id() -> str:
    """This process's replica id as Ray Serve's router names it."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def _node_id() -> str:
    """The Ray node this replica runs on (two hosts may share a name and, behind NAT, an address)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _node_ip() -> str:
    """The address of the Ray node this replica runs on (hosts may share a name; nodes have their own address)."""
    import ray

    return ray.util.get_node_ip_address()
