"""The ingress of a replicated service: HYPIC's HTTP application over ``ReplicaLoop``, which
stands where a single server's engine loop stands. It checks and plans each request once
(``FrontEngine``), hands it to the replica its router picks (``ReplicaRouter``) and relays the
replica's events. What each replica holds comes on a stream of its own (``HoldingsChannel``); an
answer is let out once the index has what its replica held when it sent it."""
import asyncio
import contextvars
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from ..cache.modes import Mode
from ..errors import HypicError
from ..router.plan import SegmentJob
from ..cache.plan import RequestPlan
from ..cache.segments import PromptParts
from ..sampling.sequence import Sequence
from ..scheduler.loop import DoneEvent, ErrorEvent, Event, Job, PeerWork, ProgressEvent, QueueFull, planned_job
from ..scheduler.requests import Request
from ..scheduler.policy import SchedulingPolicy
from ..scheduler.stats import LoopStats
from .channel import HoldingsChannel
from .front import FrontEngine
from .holdings import HoldingsMark
from .replica import PREFILLED, Mark, RemoteBuilds, ReplicaWork
from .hotspots import Copy, HotDocuments
from .routing import RouteRequest, fetch_sources, prefix_source, spread_cold_documents, spread_documents
from .slo import SloRefusal
from .state import ClusterState, RouteTo, state_named

log = logging.getLogger("hypic.cluster")
STATUS_EVERY_S = 1.0  # how often the ingress refreshes the replicas' counters (/metrics, /get_server_info)
ROUTING_COUNTERS = ("routed_by_cache", "routed_by_load", "retried", "documents_fetched", "prefixes_fetched",
                    "refused_for_slo", "documents_copied")
CALL_TIMEOUT_S = 300.0  # the most a call to a replica (warm-up, flush, status) may take
STATUS_TIMEOUT_S = 10.0  # a replica whose status takes longer (its host cut off) is left out of that refresh
ATTEMPTS = 2  # a request whose replica fails before answering is tried once more, on another
SILENCE_S = 300.0  # the longest a request's stream may stay silent (replicas send a keepalive every 2 s)
TOTALS = frozenset(LoopStats().as_dict())  # the replicas' counters that only grow (the rest are gauges)
CATCH_UP_S = 2.0  # the longest an answer waits for its replica's holdings to reach the index


def route_request(job: Job) -> RouteRequest:
    """What the router needs of a planned request: its documents' keys and the tokens splicing each saves."""
    plan = job.plan
    documents = tuple((key, plan.interior_tokens(index)) for index, key, _ in plan.documents())
    return RouteRequest(job.parts.namespace, documents, len(job.parts.token_ids), tuple(job.parts.token_ids))


def _own_call(call: Callable[[], Any]) -> Any:
    """Make a handle call outside the HTTP request's context: Ray Serve names a call by the request
    it is made in and routes calls by that name, so two calls of one request (a warm-up's shares, a
    batch's prompts) would be taken for one and one of them never sent."""
    return contextvars.Context().run(call)


def summed(values: list[Any]) -> Any:
    """The replicas' counters as one service's: numbers added, lists element by element, dicts key
    by key; anything else (a name, a policy) is the first replica's."""
    first = values[0]
    if isinstance(first, bool) or first is None or isinstance(first, str):
        return first
    if isinstance(first, (int, float)):
        return sum(v for v in values if isinstance(v, (int, float)))
    if isinstance(first, dict):  # over every replica's keys (a loop error's step may be one replica's alone)
        keys = dict.fromkeys(key for v in values if isinstance(v, dict) for key in v)
        return {key: summed([v[key] for v in values if isinstance(v, dict) and key in v]) for key in keys}
    if isinstance(first, (list, tuple)) and all(isinstance(v, (list, tuple)) and len(v) == len(first) for v in values):
        return [summed(list(column)) for column in zip(*values)]
    return first


class ReplicaSilent(HypicError):
    """A request's replica sent nothing within the ingress's deadline (a stuck call, one pinned to a
    replica that left, builds that never came)."""


@dataclass
class Attempt:
    """One try at a request, as the ingress follows it: ``key`` names its calls; times are the
    ingress's clock (``time.perf_counter``), from the request's arrival here."""

    key: str
    arrived: float
    first_token_at: float | None = None

    def first_token(self) -> bool:
        """Note the first token's arrival; True if this was it."""
        if self.first_token_at is not None:
            return False
        self.first_token_at = time.perf_counter()
        return True

    def timed(self, event: Event) -> Event:
        """An end as the ingress saw it: TTFT and latency from the arrival here (builds elsewhere, routing
        and the replica's queue included), not from the replica's receipt of the call."""
        if not isinstance(event, DoneEvent):
            return event
        now = time.perf_counter()
        first = self.first_token_at if self.first_token_at is not None else now
        return replace(event, completion=replace(event.completion, ttft_s=first - self.arrived, e2e_s=now - self.arrived))


def refused_for_room(err: BaseException) -> QueueFull | None:
    """The ``QueueFull`` a replica raised, as Ray hands it back (the error itself or its cause), or None."""
    for candidate in (err, getattr(err, "cause", None), err.__cause__):
        if isinstance(candidate, QueueFull):
            return candidate
    return None


class ReplicaLoop:
    """The ``ServingLoop`` of a replicated service's ingress: each request run on the replica its
    router picks."""

    def __init__(self, front: FrontEngine, replicas: DeploymentHandle, state: ClusterState, mode: Mode | str,
                 max_state_bytes: int | None, spreads: bool = True, silence_s: float = SILENCE_S,
                 ingresses: int = 1, refusal: SloRefusal = SloRefusal()) -> None:
        self.engine, self.mode, self.state, self.silence_s = front, Mode.parse(mode), state, silence_s
        self.ingresses = ingresses  # of the service (this one included): its own counters are labelled by name
        self.refusal = refusal  # a request no replica would serve within the latency objectives is refused at once
        self.hot = HotDocuments()  # documents many requests name, copied off a busy replica ahead of need
        self.name, self.calls = uuid.uuid4().hex[:8], itertools.count()  # call keys: unique across ingresses
        # a replica of several ranks holds shards: its documents are not built by another replica
        self.spreads = spreads and front.policy(self.mode).caches_segments
        self.replicas, self.policy = replicas, SchedulingPolicy(max_state_bytes=max_state_bytes)  # refuses what never fits
        self.tasks: set[asyncio.Task] = set()
        self.statuses: dict[str, dict[str, Any]] = {}
        self.retired: dict[str, Any] = {}  # the totals of replicas gone (a replacement counts from zero)
        self.answered = LoopStats()  # the requests' TTFTs as measured here
        self.running: asyncio.AbstractEventLoop | None = None
        self.channel = HoldingsChannel(state, self._open_holdings)

    def sample_seed(self) -> int | None:
        return None  # each replica's own generator (a tensor-parallel replica draws one for its ranks)

    def job_for(self, parts: PromptParts, request: Request, sequences: list[Sequence],
                plan: RequestPlan | None = None) -> Job:
        """``planned_job`` of the front engine: planned here once, run on a replica as it is."""
        return planned_job(self.engine, self.mode, self.policy, parts, request, sequences, plan)

    # ----- requests ----------------------------------------------------------------------------
    def enqueue(self, job: Job, emit: Callable[[Event], None], peer_work: PeerWork | None = None) -> Job:
        """Start ``job`` on a replica; its events reach ``emit``. Called on the ingress's event loop."""
        task = asyncio.get_running_loop().create_task(self._run(job, emit))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return job

    async def _run(self, job: Job, emit: Callable[[Event], None]) -> None:
        """Run ``job`` on a replica; if that replica fails before the client was sent anything (a
        stream's first token, or any answer at all), once more on another."""
        heard = False

        def relay(event: Event) -> None:
            nonlocal heard
            heard = heard or job.request.stream or isinstance(event, (DoneEvent, ErrorEvent))
            emit(event)

        request = route_request(job)  # what every attempt is routed by
        if self.spreads:  # on the serving loop, as the copies it asks for (``keep_fresh``)
            self.hot.seen(request, [ids for _, _, ids in job.plan.documents()])
        over = self._over_slo(request)
        if over is not None:
            self.state.count("refused_for_slo")
            emit(ErrorEvent(over, busy=True))
            return
        tried: set[str] = set()  # the replicas that failed it, filled by each attempt
        try:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    return await self._attempt(job, request, relay, spread=attempt == 1, tried=tried)
                except Exception as err:  # noqa: BLE001 - the replica died, failed or was full
                    if heard or attempt == ATTEMPTS or job.cancelled.is_set():
                        raise
                    log.warning("request %s: replica %s failed before answering (%s); retried on another", job.rid,
                                ", ".join(sorted(tried)) or "(not reached)", err)
                    self.state.count("retried")
        except Exception as err:  # noqa: BLE001 - the client hears why
            full = refused_for_room(err)
            if full is not None:
                log.warning("request %s refused: every replica tried was full (%s)", job.rid, full)
                emit(ErrorEvent(f"every replica tried is full: {full}", busy=True))
                return
            if job.cancelled.is_set():  # its client left: the replica's work was cancelled on purpose
                log.info("request %s cancelled by its client", job.rid)
            else:
                log.error("request %s failed on its replica: %s", job.rid, err)
            emit(ErrorEvent(f"the replica serving the request failed: {type(err).__name__}: {err}"))

    def _over_slo(self, request: RouteRequest) -> str | None:
        """Why ``request`` is refused at once (None: it is not): no replica is predicted to give its
        first token within the TTFT objective and then its tokens within the TBT one (``SloRefusal``)."""
        if not self.refusal.active:
            return None
        replicas = list(self.state.replicas)
        ttft = self.state.predicted_ttft(request, replicas) if self.refusal.ttft_s is not None else {}
        return self.refusal.why(ttft, self.state.predicted_tbt(replicas) if self.refusal.tbt_s is not None else {})

    async def _attempt(self, job: Job, request: RouteRequest, emit: Callable[[Event], None], spread: bool,
                       tried: set[str]) -> None:
        """One try at ``job`` (routed by ``request``), on a replica not in ``tried`` while there is one
        (the one it reached is added to ``tried`` when it ends); with ``spread``, its cold documents
        may be built on other replicas (``spread_cold_documents``) while the chosen one takes it."""
        attempt = Attempt(f"{job.rid}@{self.name}.{next(self.calls)}", job.start)
        route = RouteTo(attempt.key, request, avoid=frozenset(tried),
                        decode_tokens=job.request.params.max_new_tokens * len(job.sequences))
        work = ReplicaWork(job.rid, job.parts, job.request, job.plan, time.perf_counter() - job.start)
        try:
            route, builds = await self._spread(job, route) if spread and self.spreads else (route, None)
            extra = [builds] if builds is not None else []
            stream = _own_call(lambda: self.replicas.options(method_name="run", stream=True).remote(route, work, *extra))
            watcher = asyncio.get_running_loop().create_task(self._cancel_when_asked(job, stream))
            try:
                async for item in self._messages(stream):
                    await self._relay(attempt, item, emit)
            finally:
                watcher.cancel()
        finally:
            replica = self.state.finished(attempt.key)
            if replica is not None:
                tried.add(replica)

    async def _messages(self, stream: Any) -> AsyncIterator[Any]:
        """The stream's messages, each within ``silence_s`` of the last (or of the call), else
        ``ReplicaSilent`` and the call cancelled."""
        messages = stream.__aiter__()
        while True:
            try:
                yield await asyncio.wait_for(messages.__anext__(), self.silence_s)
            except StopAsyncIteration:
                return
            except TimeoutError:
                stream.cancel()
                raise ReplicaSilent(f"its replica sent nothing in {self.silence_s:g} s") from None

    async def _spread(self, job: Job, route: RouteTo) -> tuple[RouteTo, RemoteBuilds | None]:
        """The replica the policy picks for ``job``, pinned, and the calls that bring it the documents
        it does not hold, started: those another replica holds in memory fetched from it
        (``fetch_sources``), those none holds built on the least loaded (``spread_cold_documents``);
        None: the router picks as usual. The calls' results travel to the chosen replica as object
        references inside ``RemoteBuilds``: Ray Serve would wait for results passed as arguments
        before it delivers the call, and the replica's own builds would start only after theirs."""
        assert route.request is not None
        replicas = list(self.state.replicas)
        decision = self.state.choose(route.request, replicas)
        with self.state.lock:
            loads = self.state.current_loads(replicas)
            fetches = fetch_sources(route.request, decision.replica, loads, self.state.index)
            fetched = frozenset(i for indices in fetches.values() for i in indices)
            builds = spread_cold_documents(route.request, decision.replica, loads, self.state.index, fetched=fetched)
            head_from = prefix_source(route.request, decision.replica, loads, self.state.index)
        if not builds and not fetches and head_from is None:
            return route, None
        documents, calls = list(job.plan.documents()), []
        for replica, indices, built in [*((r, i, True) for r, i in builds.items()),
                                        *((r, i, False) for r, i in fetches.items())]:
            jobs = [SegmentJob(documents[i][1], documents[i][2], job.parts.namespace) for i in indices]
            if built:  # a fetch adds no prefill to its sender
                self.state.building(route.key, replica, sum(route.request.documents[i][1] for i in indices))
            pinned = RouteTo(f"{route.key}-build", replica=replica)
            calls.append(_own_call(lambda: self.replicas.options(method_name="build").remote(pinned, jobs)))
        if head_from is not None:
            sender = RouteTo(f"{route.key}-head", replica=head_from)
            calls.append(_own_call(lambda: self.replicas.options(method_name="lend_prefix").remote(sender, job.plan)))
            self.state.count("prefixes_fetched")
        # each reference once its call is placed (a replica that left never takes it: the deadline)
        refs = await asyncio.wait_for(asyncio.gather(*(call._to_object_ref() for call in calls)), self.silence_s)
        head = refs.pop() if head_from is not None else None
        remote = tuple((documents[i][1], route.request.documents[i][1]) for indices in builds.values() for i in indices)
        copies = tuple(documents[i][1] for i in sorted(fetched))
        self.state.count("documents_fetched", len(copies))
        placed = replace(route, replica=decision.replica, reason=decision.reason, fetched=frozenset(copies))
        return placed, RemoteBuilds(tuple(refs), remote, self.silence_s, copies, head)

    async def _relay(self, attempt: Attempt, item: list[Event] | HoldingsMark | Mark, emit: Callable[[Event], None]) -> None:
        if isinstance(item, HoldingsMark):
            await self._caught_up(item)
            return
        if isinstance(item, Mark):
            if item == PREFILLED:
                self._prefilled(attempt)
            return  # a keepalive: the silence deadline starts again
        if item and isinstance(item[0], ProgressEvent):
            self._prefilled(attempt)
        if item and isinstance(item[-1], (DoneEvent, ErrorEvent)):
            # its load leaves the replica before its client hears the end and may send the next request
            # (the replica's stream closes a message later)
            self.state.finished(attempt.key)
        for event in item:
            event = attempt.timed(event)
            if isinstance(event, DoneEvent):
                self.answered.add_finished(event.completion)
            emit(event)

    def _prefilled(self, attempt: Attempt) -> None:
        if attempt.first_token():
            self.state.prefilled(attempt.key)

    @staticmethod
    async def _cancel_when_asked(job: Job, stream: Any) -> None:
        """A client that left cancels its job here; the replica's stream is cancelled with it."""
        while not job.cancelled.is_set():
            await asyncio.sleep(0.25)
        stream.cancel()

    # ----- the index -----------------------------------------------------------------------------
    def _open_holdings(self, replica: str, after: tuple[str, int] | None) -> Any:
        route = RouteTo(f"holdings-{replica}@{self.name}.{next(self.calls)}", replica=replica)
        return _own_call(lambda: self.replicas.options(method_name="holdings", stream=True).remote(route, after))

    async def _caught_up(self, mark: HoldingsMark) -> None:
        """Wait until the index has what ``mark``'s replica held when it set it (briefly: a stream
        that lags is the channel's to repair; the answer goes out anyway)."""
        self.channel.sync()
        if not await self.channel.caught_up(mark, CATCH_UP_S):
            log.warning("replica %s's holdings up to event %d did not reach the index in %g s", mark.replica,
                        mark.seq, CATCH_UP_S)

    async def _call(self, replica: str, method: str, *args: Any) -> Any:
        route = RouteTo(f"{method}-{replica}", replica=replica)
        call = _own_call(lambda: self.replicas.options(method_name=method).remote(route, *args))
        return await asyncio.wait_for(call, CALL_TIMEOUT_S)

    def serve_on(self, running: asyncio.AbstractEventLoop) -> None:
        """The event loop the HTTP requests run on: warm-ups and flushes run there, and the replicas'
        counters are refreshed there (from the first request on)."""
        if self.running is not running:
            self.running = running
            self.tasks.add(running.create_task(self.keep_fresh()))

    async def wait_for_replicas(self, count: int, timeout_s: float) -> list[str]:
        """Start the router (one status call) and wait until it lists ``count`` replicas."""
        await asyncio.wait_for(_own_call(lambda: self.replicas.options(method_name="status").remote(RouteTo("start"))),
                               timeout_s)
        deadline = time.monotonic() + timeout_s
        while len(self.state.replicas) < count:
            if time.monotonic() > deadline:
                raise HypicError(f"only {len(self.state.replicas)} of {count} replicas started in {timeout_s:.0f} s")
            await asyncio.sleep(0.05)
        self.channel.sync()  # a restarted ingress learns what each already holds (a dump each)
        await self.channel.heard_from_all(timeout_s)
        await self.refresh()
        return list(self.state.replicas)

    # ----- warm-up, flush, counters --------------------------------------------------------------
    def warmup(self, documents: list[str], namespace: str = "") -> Future:
        """Spread ``documents`` over the replicas (longest first, each to the least loaded) and cache
        each share there; the future holds the token counts in the documents' order. Called off the
        event loop."""
        self.engine.check_documents(documents)
        return asyncio.run_coroutine_threadsafe(self._warmup(documents, namespace), self._loop())

    async def _warmup(self, documents: list[str], namespace: str) -> list[int]:
        """Each document warmed on one replica (longest first to the least loaded); a share whose
        replica died meanwhile is warmed again on those left (once)."""
        tokens = [len(self.engine.tokenizer.encode(d)) for d in documents]
        counts: list[int | None] = [None] * len(documents)
        dead: set[str] = set()
        for last in (False, True):
            wanted = [i for i, count in enumerate(counts) if count is None]
            with self.state.lock:
                loads = self.state.current_loads([r for r in self.state.replicas if r not in dead] or self.state.replicas)
            where = spread_documents([tokens[i] for i in wanted], loads)
            shares = {r: [wanted[n] for n, w in enumerate(where) if w == r] for r in set(where)}
            answers = await asyncio.gather(*(self._call(r, "warmup", [documents[i] for i in idx], namespace)
                                             for r, idx in shares.items()), return_exceptions=True)
            for (replica, indices), answer in zip(shares.items(), answers):
                if isinstance(answer, RayActorError) and not last:
                    log.warning("replica %s died while it warmed %d documents: warmed on another", replica, len(indices))
                    dead.add(replica)
                    continue
                if isinstance(answer, BaseException):
                    raise answer
                share_counts, mark = answer
                await self._caught_up(mark)
                for i, count in zip(indices, share_counts):
                    counts[i] = count
            if all(count is not None for count in counts):
                break
        await self.refresh()
        return [count or 0 for count in counts]

    def flush(self, namespace: str | None, tiers: frozenset[str]) -> Future:
        """Flush every replica; the future holds the summed counts (public, private, lower tiers)."""
        return asyncio.run_coroutine_threadsafe(self._flush(namespace, tiers), self._loop())

    async def _flush(self, namespace: str | None, tiers: frozenset[str]) -> tuple[int, int, int]:
        """Flush every replica; one that died meanwhile is left out (its pools died with it), one that
        failed otherwise fails the flush, named."""
        replicas = list(self.state.replicas)
        outcomes = await asyncio.gather(*(self._call(r, "flush", namespace, tiers) for r in replicas),
                                        return_exceptions=True)
        answers = []
        for replica, outcome in zip(replicas, outcomes):
            if isinstance(outcome, RayActorError):
                log.warning("replica %s died before it flushed (%s): left out of the flush", replica, outcome)
            elif isinstance(outcome, BaseException):
                raise HypicError(f"replica {replica} could not flush: {type(outcome).__name__}: {outcome}") from outcome
            else:
                answers.append(outcome)
        for _, mark in answers:
            await self._caught_up(mark)
        await self.refresh()
        return tuple(summed([flushed[i] for flushed, _ in answers]) if answers else 0 for i in range(3))  # type: ignore[return-value]

    async def refresh(self) -> None:
        """Every replica's status (its counters, pools and documents), kept for ``snapshot``."""
        replicas = list(self.state.replicas)
        answers = await asyncio.gather(*(asyncio.wait_for(self._call(r, "status"), STATUS_TIMEOUT_S) for r in replicas),
                                       return_exceptions=True)
        fresh = {r: a for r, a in zip(replicas, answers) if isinstance(a, dict)}
        self.state.pools_filled({r: a["public_pool_fill"] for r, a in fresh.items()})
        self.state.rates_reported({r: {**a["counters"], "chunk_tokens": a.get("chunk_tokens")} for r, a in fresh.items()})
        if self.ingresses > 1:  # the others' work on the replicas: one ingress knows all its replicas do
            self.state.loads_reported({r: a["counters"]["load"] for r, a in fresh.items() if "load" in a["counters"]})
        self.statuses.update(fresh)  # a replica slow to answer this time keeps its last status
        self._retire_gone()

    def _retire_gone(self) -> None:
        """The last totals of replicas gone join ``retired``: the service's counters never go back."""
        with self.state.lock:
            live = set(self.state.replicas)
        for replica in [r for r in self.statuses if r not in live]:
            counters = self.statuses.pop(replica)["counters"]
            self.retired = summed([self.retired, {k: v for k, v in counters.items() if k in TOTALS}])

    async def keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(STATUS_EVERY_S)
            self.channel.sync()  # a replica that joined is followed, one gone no longer
            try:
                await self.refresh()
            except Exception as err:  # noqa: BLE001 - counters a second old are better than none
                log.warning("could not refresh the replicas' status: %s", err)
            if self.spreads:
                self.copy_hot_documents()

    def copy_hot_documents(self) -> list[asyncio.Task]:
        """Start the copies ``HotDocuments`` asks for: the holder sends its entry (its ``build`` call
        returns what it holds), the target keeps it where it fits (``keep_copies``), in the background."""
        with self.state.lock:
            copies = self.hot.copies(self.state.current_loads(list(self.state.replicas)), self.state.index)
        tasks = [self._loop().create_task(self._copy(copy)) for copy in copies]
        self.tasks.update(tasks)
        for task in tasks:
            task.add_done_callback(self.tasks.discard)
        return tasks

    async def _copy(self, copy: Copy) -> None:
        job = SegmentJob(copy.key, copy.token_ids, copy.namespace)
        try:
            sent = _own_call(lambda: self.replicas.options(method_name="build").remote(
                RouteTo(f"copy-{copy.key}", replica=copy.source), [job]))
            kept = await self._call(copy.target, "keep_copies", sent)
        except Exception as err:  # noqa: BLE001 - a copy ahead of need may fail: requests fetch it as before
            log.warning("a hot document's copy from replica %s to %s failed: %s", copy.source, copy.target, err)
            return
        if kept:
            self.state.count("documents_copied", len(kept))
            log.info("hot document %s copied from replica %s to %s", copy.key[:12], copy.source, copy.target)

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self.running is None:
            raise HypicError("the ingress has not started")
        return self.running

    @property
    def snapshot(self) -> dict[str, Any]:
        """The replicas' counters summed (numbers only), with the routing counters and each replica's status."""
        self._retire_gone()
        statuses = self._live_statuses()
        total = summed([status["counters"] for status in statuses]) if statuses else {}
        total |= {key: summed([total[key], value]) if key in total else value for key, value in self.retired.items()}
        total |= {"ttft_sum_s": self.answered.ttft_sum_s, "ttft_buckets": list(self.answered.ttft_buckets),
                  "ttft_count": self.answered.requests_finished}  # measured here: builds elsewhere included
        with self.state.lock:
            routing = {name: self.state.counters[name] for name in ROUTING_COUNTERS}
            rates = {replica: measured.current() for replica, measured in self.state.rates.items()}
        replicas = [{"index": i, **{k: v for k, v in status.items() if k != "counters"},
                     "queued": status["counters"].get("waiting_requests", 0),
                     "running": status["counters"].get("running_requests", 0),
                     "measured_rates": _as_dict(rates.get(status["replica"]))}  # what the ttft policy routes by
                    for i, status in enumerate(statuses)]
        weights = statuses[0].get("weight_bytes", 0) if statuses else 0  # every replica holds the same model
        ingress = {"ingress": self.name, "ingress_pid": os.getpid(), "ingress_replicas": self.ingresses}
        return {**total, "weight_bytes": weights, "routing": routing,
                "data_parallel": {"dp_size": len(self.state.replicas), **ingress, "policy": self.state.policy.name,
                                  "replicas": replicas}}

    def _live_statuses(self) -> list[dict[str, Any]]:
        """The last statuses of the replicas still running, in id order: a replica that died leaves the
        report as soon as Ray Serve says so, not when a refresh waiting on its status gives up (10 s)."""
        with self.state.lock:
            live = set(self.state.replicas)
        return [self.statuses[r] for r in sorted(self.statuses) if r in live]

    @property
    def alive(self) -> bool:
        return bool(self.state.replicas)

    @property
    def failure(self) -> str | None:
        return None if self.state.replicas else "no replica is serving"


class ReplicaRouter(RequestRouter):
    """Ray Serve's request router for HYPIC's replicas: each request to the replica its policy
    scores best (then the others, best first, in case that one is full); a call for one replica
    to that replica only."""

    def initialize_state(self, state: str = "") -> None:
        self.state_name = state

    def _state(self) -> ClusterState:
        state = state_named(self.state_name)
        if state is None:
            raise HypicError(f"no cluster state named {self.state_name!r} in this process")
        return state

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if pending_request is not None:  # without it Ray Serve retries at once, starving its own probes
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if not isinstance(route, RouteTo) or (route.request is None and route.replica is None):
            return [candidate_replicas]
        by_id = {r: replica for r, replica in by_id.items() if r not in route.avoid} or by_id
        if route.replica is not None:  # a call for one replica, or a request the ingress placed itself
            return [[by_id[route.replica]]] if route.replica in by_id else []
        decision = self._state().choose(route.request, list(by_id), key=route.key)
        ranked = sorted(by_id, key=lambda r: (r != decision.replica, decision.costs.get(r, 0.0), r))
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        route = pending_request.args[0] if pending_request.args else None
        if isinstance(route, RouteTo) and route.request is not None:
            self._state().routed(route.key, replica_id.unique_id, route.request, route.decode_tokens,
                                 route.reason if route.replica is not None else None, route.fetched)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._tell_state()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """A dead replica leaves the index at once (not when the controller notices)."""
        super().on_replica_actor_died(replica_id)
        self._tell_state()

    def _tell_state(self) -> None:
        state = state_named(getattr(self, "state_name", ""))
        if state is not None:
            state.set_replicas([r.replica_id.unique_id for r in self._replicas.values()])


def _as_dict(rates: Any) -> dict[str, Any] | None:
    return None if rates is None else asdict(rates)
