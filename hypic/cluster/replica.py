"""One replica of a replicated service: a whole instance (engine, loop, pools, tiers; with
``--tp-size`` a lockstep group of ranks) that runs requests planned at the ingress and tells the
ingress what documents it holds after each piece of work."""
import asyncio
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from ..cache.hybrid_cache import HybridCache
from ..cache.plan import RequestPlan
from ..cache.segments import PromptParts
from ..scheduler.loop import DoneEvent, ErrorEvent, Event, ProgressEvent
from ..server.protocol import GenerationRequest
from .index import Announcement, HoldingEvent, Tier

LOOP_CHECK_S = 1.0  # how often a request waiting for its next event looks whether the loop still runs


@dataclass(frozen=True)
class ReplicaWork:
    """A request as the ingress checked and planned it: the replica runs it as it is, re-planning
    nothing. ``waited_s``: how long it was at the ingress (its TTFT counts from its arrival there)."""

    rid: str
    parts: PromptParts
    request: GenerationRequest
    plan: RequestPlan
    waited_s: float = 0.0


class HoldingsFeed:
    """What a replica's memory holds, told as numbered changes since the last telling (or in full,
    when the ingress lost track). Calls come from the replica's request threads; a lock keeps the
    numbering whole."""

    def __init__(self, cache: HybridCache, replica: str) -> None:
        self.cache, self.replica = cache, replica
        self.incarnation = uuid.uuid4().hex  # a restarted replica starts a new numbering
        self.known: dict[str, int] = {}  # key -> tokens, as last told
        self.seq = 0
        self.lock = threading.Lock()

    def changes(self) -> Announcement:
        """What changed since the last announcement (stored, evicted), numbered on from it."""
        with self.lock:
            held = self.cache.document_keys()
            stored = sorted(held - self.known.keys())
            events = [HoldingEvent("evicted", key, "", Tier.MEMORY) for key in sorted(self.known.keys() - held)]
            events += [HoldingEvent("stored", key, "", Tier.MEMORY, tokens) for key, tokens in self._tokens(stored)]
            self.known = {key: self.known.get(key, 0) for key in held} | dict(self._tokens(stored))
            self.seq += len(events)
            return Announcement(self.replica, self.incarnation, self.seq, tuple(events))

    def dump(self) -> Announcement:
        """Everything held now, replacing what the ingress believed."""
        self.changes()
        with self.lock:
            events = tuple(HoldingEvent("stored", key, "", Tier.MEMORY, tokens) for key, tokens in self.known.items())
            return Announcement(self.replica, self.incarnation, self.seq, events, full=True)

    def _tokens(self, keys: list[str]) -> list[tuple[str, int]]:
        return [(entry.key, len(entry.token_ids)) for entry in self.cache.held_documents(keys)]


class Replica:
    """The replica deployment's body. ``start_instance(args)`` builds the instance as ``hypic
    serve ARGS`` would (its loop started); ``replica``: this replica's id (Ray Serve's)."""

    def __init__(self, args: Any, start_instance: Callable[[Any], Any], replica: str | None = None) -> None:
        self.instance = start_instance(args)
        self.replica = replica or _serve_replica_id()
        self.feed = HoldingsFeed(self.instance.engine.cache, self.replica)
        self.started = time.time()

    async def run(self, route: Any, work: ReplicaWork) -> AsyncIterator[Event | Announcement]:
        """The request's events, as its loop emits them, then what the replica holds now. ``route``
        is for the router (which replica); the replica ignores it."""
        job = self._job(work)
        events: asyncio.Queue[Event] = asyncio.Queue()
        running = asyncio.get_running_loop()
        self.instance.loop.enqueue(job, lambda event: running.call_soon_threadsafe(events.put_nowait, event))
        try:
            while True:
                event = await self._next(events)
                yield self._stamped(event)
                if isinstance(event, (DoneEvent, ErrorEvent)):
                    break
        finally:
            job.cancel()  # no-op once finished; a client that left stops the work here
        yield self.feed.changes()

    def _job(self, work: ReplicaWork) -> Any:
        loop, request = self.instance.loop, work.request
        top = request.logprobs.top if request.logprobs is not None else None
        sequences = self.instance.engine.sequences(request.params, list(work.parts.token_ids), top,
                                                   seed=loop.sample_seed())
        job = loop.job_for(work.parts, request, sequences, work.plan)
        job.rid, job.start = work.rid, time.perf_counter() - work.waited_s
        return job

    async def _next(self, events: asyncio.Queue[Event]) -> Event:
        loop = self.instance.loop
        while True:
            try:
                return await asyncio.wait_for(events.get(), timeout=LOOP_CHECK_S)
            except TimeoutError:
                if not loop.alive or loop.failure is not None:
                    return ErrorEvent(loop.failure or "the engine loop has stopped")

    def _stamped(self, event: Event) -> Event:
        if isinstance(event, (ProgressEvent, DoneEvent)):
            return replace(event, completion=replace(event.completion, replica=self.replica))
        return event

    async def warmup(self, route: Any, documents: list[str], namespace: str) -> tuple[list[int], Announcement]:
        """Cache ``documents`` here; their token counts, and what is held now."""
        future = await asyncio.to_thread(self.instance.loop.warmup, documents, namespace)
        counts = await asyncio.wrap_future(future)
        return counts, self.feed.changes()

    async def flush(self, route: Any, namespace: str | None, tiers: frozenset[str]) -> tuple[Any, Announcement]:
        flushed = await asyncio.wrap_future(self.instance.loop.flush(namespace, tiers))
        return flushed, self.feed.changes()

    async def dump(self, route: Any) -> Announcement:
        return self.feed.dump()

    async def status(self, route: Any) -> dict[str, Any]:
        """Who this replica is and how busy: what ``/get_server_info`` lists per replica and
        ``/metrics`` sums."""
        loop, cache = self.instance.loop, self.instance.engine.cache
        pools = cache.describe()
        return {"replica": self.replica, "pid": os.getpid(), "node": socket.gethostname(), "node_ip": _node_ip(),
                "counters": loop.snapshot, "documents_held": len(cache.document_keys()),
                "public_pool_bytes": pools["public_pool"]["bytes"], "private_pool_bytes": pools["private_pool"]["bytes"],
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


def _node_ip() -> str:
    """The address of the Ray node this replica runs on (hosts may share a name; nodes have their own address)."""
    import ray

    return ray.util.get_node_ip_address()
