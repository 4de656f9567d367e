"""Peer prefill for ``hypic serve --workers N``: the server process is worker 0 (its engine loop
serves every endpoint and decodes every request as with one worker); workers 1..N-1 are Ray
actors that prefill the request's cold documents alongside it. The combine node is the worker
with the best cache-aware score (``plan.combine_score``; the server on ties): the server itself
(peers ship their entries here), or a peer (everyone ships there; it runs the combine pass and
sends back the request's state, which the server decodes).

A request's peer work is a ``PeerRequest``: started by the loop on its own thread once the loop
has admitted the request (a slot and room for its state), it goes by the request's
``RequestPlan`` (made once, when the request arrived) and touches the engine only on the loop's
thread. Threads of this module wait on Ray and on transfers, never on the loop: what they bring
back (entries, their end) is posted to the loop's queue, which the loop drains between chunks.
A request's peer work has a deadline (the worker timeout): past it, the request runs here alone
and what its peers bring later is ignored."""
import dataclasses
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from hypic import default_model_path
from hypic.cache.modes import Mode
from hypic.cache.plan import RequestPlan
from hypic.cache.store import SegmentEntry
from hypic.engine import Prefill
from hypic.loading.loader import model_fingerprint
from hypic.prefill_stats import BuiltForRequest, PrefillStats
from hypic.scheduler.loop import EngineLoop as Loop

from .plan import Plan, document_jobs, make_plan
from .pool import WorkerPool, start_ray
from .transfer import ReceiveCounts, entry_check, install_entries, receive_all

LOCAL = 0  # the server's own engine


@dataclass
class Dispatch:
    """A plan whose peer work has started: its build and shipment refs (see ``WorkerPool.dispatch``)."""

    plan: Plan
    mode: Mode
    builds: list[tuple[int, ray.ObjectRef]]
    shipments: list[tuple[int, ray.ObjectRef]]


class PeerPrefill:
    """Plans each request's documents over the local engine (worker 0) and the peers, starts the
    peers' part, and brings back what the combine node needs: entries for the server, or a remote
    ``Prefill``."""

    def __init__(self, model: str, workers: int, *, threads: int = 1, ray_address: str | None = None,
                 seam_width: int = 8, timeout_s: float = 300.0, engine_options: dict[str, Any] | None = None,
                 transfer: str = "torch") -> None:
        if not isinstance(workers, int) or workers < 2:
            raise ValueError(f"peer prefill needs at least 2 workers, got {workers!r}")
        start_ray((workers - 1) * threads, ray_address)
        peers = list(range(1, workers))
        self._attach(WorkerPool(model, peers, threads, {**(engine_options or {}), "seam_width": seam_width}, (LOCAL,),
                                timeout_s, transfer))
        fingerprint = model_fingerprint(default_model_path() if model == "default" else Path(model))
        if any(f != fingerprint for f in self.pool.fingerprints()):
            raise RuntimeError("the workers loaded a different model than the server")

    def _attach(self, pool: WorkerPool) -> None:
        """Serve with ``pool``'s workers as the peers (worker 0, ``LOCAL``, is the caller's engine)."""
        self.pool = pool
        self.received = ReceiveCounts()  # entries this server received as combine node
        self.waits = ThreadPoolExecutor(32, thread_name_prefix="hypic-peer-wait")  # wait on peers, never on the loop

    def prefill_for(self, loop: Loop, request: RequestPlan) -> Future:
        """Start a request's peer work; called on the loop's thread (the loop admits it there). The
        future holds (a future of the remote ``Prefill``, or None: combined here; what was built
        for the request); it is done within the worker timeout (``PeerTimeout`` past it)."""
        return PeerRequest(self, loop, request).start(self.pool.timeout_s)

    def warmup_for(self, loop: Loop, documents: list[str], namespace: str = "") -> Future:
        """Documents (checked already, as the engine's own warm-up checks them) spread by LPT over the
        server's loop and the peers, each cached where it is built; the future holds their token
        counts. Planned on the loop's thread (what it holds is read there), from any thread."""
        counts: Future = Future()
        loop.call(lambda: self._start_warmup(loop, documents, namespace, counts))
        return counts

    def _start_warmup(self, loop: Loop, documents: list[str], namespace: str, counts: Future) -> None:
        """On the loop's thread: the warm-up's plan, its local builds queued, the peers' started."""
        try:
            engine = loop.engine
            request = engine.plan(engine.planner.documents(documents, namespace), loop.mode)
            plan = self.plan(request, engine.cache.document_keys(), combine=LOCAL)
            local = self.local_segments(plan)
            building = loop.build(local, namespace) if local else None
        except Exception as err:  # noqa: BLE001 - handed to the caller, who reports it
            counts.set_exception(err)
            return
        sizes = [len(segment) for segment in request.parts.segments]
        self.waits.submit(self._finish_warmup, plan, loop.mode, building, sizes, counts)

    def _finish_warmup(self, plan: Plan, mode: Mode, building: Future | None, sizes: list[int],
                       counts: Future) -> None:
        """Off the loop: the peers' builds waited for; the counts once the local ones are done too."""
        try:
            self.pool.cache(plan, mode)
        except Exception as err:  # noqa: BLE001 - handed to the caller, who reports it
            counts.set_exception(err)
            return
        (building or _done(None)).add_done_callback(lambda done: _settle(counts, done, sizes))

    def plan(self, request: RequestPlan, held_locally: frozenset[str] | set[str], combine: int | None = None) -> Plan:
        """Documents the local engine holds are hits there; the rest go by LPT over every live worker,
        the request's combine pass counted on its combine node. The combine node is the best-scoring
        worker unless ``combine`` says (a warm-up: nothing is combined)."""
        jobs = document_jobs(request)
        combine_tokens = 0 if combine is not None else request.recomputed_tokens()
        with self.pool.lock:
            self.pool.index.sync(LOCAL, [job.key for job in jobs if job.key in held_locally])
            return make_plan(jobs, self.pool.index, dict(self.pool.queued), combine=combine,
                             combine_tokens=combine_tokens)

    def flush(self, namespace: str | None = None) -> int:
        """Empty the peers' pools (``namespace``: of that cache namespace only); returns the entries they dropped."""
        return self.pool.flush(namespace)

    @staticmethod
    def local_segments(plan: Plan) -> list[tuple[int, ...]]:
        """The cold documents the local engine prefills itself."""
        return [job.token_ids for job in plan.builds.get(LOCAL, [])]

    def dispatch(self, plan: Plan, mode: Mode) -> Dispatch:
        """Start the peers' part of ``plan`` (their builds and pulls); returns at once."""
        builds, shipments = self.pool.dispatch(plan, mode)
        return Dispatch(plan, mode, builds, shipments)

    def arrivals(self, dispatch: Dispatch, check: Callable[[SegmentEntry], None]) -> Iterator[tuple[list[SegmentEntry], int]]:
        """A local-combine plan's shipments as each arrives: its entries, received point-to-point into
        buffers sized by their ``check``-ed headers, and how many shipments are still to come (a
        failed transfer breaks the group and its entries are left out; a lost peer's are missing: the
        local combine pass recomputes them). The plan is finished when the iteration ends."""
        group, lost = self.pool.group, []
        try:
            for index, shipment in enumerate(dispatch.shipments):
                received: list[SegmentEntry] = []
                for batch in self.pool.wait([shipment], lost, builds=True):
                    received, counts = receive_all(group.channel if group else None, batch, check)
                    self.received.add(counts)
                    self.pool.note_receipt(counts)
                yield received, len(dispatch.shipments) - 1 - index
            self.pool.wait(dispatch.builds, lost)
        finally:
            self.pool.finish(dispatch.plan, lost)

    @staticmethod
    def local_shipment(plan: Plan) -> list[str]:
        """Keys the server must send to a remote combine node: what it builds and what it holds."""
        return [job.key for job in plan.builds.get(LOCAL, [])] + plan.pulls.get(LOCAL, [])

    def prefill_remotely(self, dispatch: Dispatch, request: RequestPlan, local_entries: list[SegmentEntry],
                         built: BuiltForRequest) -> Prefill:
        """Blocks until the remote combine node has received every entry and run the request's
        combine pass; returns its ``Prefill`` (the state the server decodes; its stats count
        ``built`` and the heads combined early as computed for the request). Raises if the combine
        node is lost (it is forgotten; the caller prefills locally instead)."""
        return self.pool.run_on_combine(
            dispatch.plan, request, dispatch.mode, (dispatch.builds, dispatch.shipments), built,
            lambda combine, shared, built: combine.prefill.remote(shared, built),
            local_entries, self.pool.timeout_s).value

    def status(self) -> dict[str, Any]:
        status = self.pool.status()
        return {**status, "workers": [LOCAL, *status["workers"]], "received_entries": dataclasses.asdict(self.received)}

    def close(self) -> None:
        """Stop waiting on peers: waits not started are cancelled, no more start."""
        self.waits.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        """``close``, and stop the workers."""
        self.close()
        self.pool.shutdown()


class PeerTimeout(TimeoutError):
    """A request's peer work did not finish within the worker timeout."""


class PeerRequest:
    """One request's peer work. Every method but ``_receive`` and ``_expire`` runs on the loop's
    thread: started there, then moved on by what is posted to the loop's queue (the local builds
    done, each shipment received, an early combine done, the last shipment in). Its ``outcome``
    holds (a future of the remote ``Prefill`` or None, what was built for the request); once it is
    done (or timed out), what comes later is ignored."""

    def __init__(self, peers: PeerPrefill, loop: Loop, request: RequestPlan) -> None:
        self.peers, self.loop, self.request = peers, loop, request
        self.outcome: Future = Future()
        self.built = BuiltForRequest()
        self.built_here = self.all_arrived = False
        self.early: Future | None = None  # the head combined early, one at a time
        self.dispatch: Dispatch | None = None
        self.plan_released = False  # a remote plan is finished by its combine run, or by ``_give_up``

    def start(self, timeout_s: float) -> Future:
        """Documents below memory brought up (held here, never rebuilt by a peer), the documents
        planned over the workers, the local builds queued on the loop, the peers' started; the
        outcome fails with ``PeerTimeout`` if it is not done within ``timeout_s``."""
        self._expire_after(timeout_s)
        engine, mode = self.loop.engine, self.loop.mode
        loaded = engine.cache.load_from_tiers(self.request)
        plan = self.peers.plan(self.request, engine.cache.document_keys())
        self.built = dataclasses.replace(plan.built_for_request(LOCAL), loaded=loaded)
        local = self.peers.local_segments(plan)
        building = self.loop.build(local, self.request.parts.namespace) if local else _done(None)
        self.dispatch = self.peers.dispatch(plan, mode)
        if plan.combine == LOCAL:
            check = entry_check(engine.fingerprint, engine.policy(mode).role, engine.model.config)
            self.peers.waits.submit(self._receive, check)
        building.add_done_callback(lambda done: self._post(self._built_here, done))
        return self.outcome

    def _post(self, step: Callable[..., None], *args: Any) -> None:
        """``step(*args)`` on the loop's thread, when the loop next drains its queue; an error in it
        gives the peer work up (the request then runs here alone)."""
        self.loop.call(lambda: self._guarded(step, *args))

    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except Exception as err:  # noqa: BLE001 - a broken peer path costs only speed
            self._give_up(err)

    def _expire_after(self, timeout_s: float) -> None:
        """A timer (its own thread: the loop may be busy) that fails the outcome at the deadline."""
        timer = threading.Timer(timeout_s, self._expire, args=(timeout_s,))
        timer.daemon = True
        timer.start()
        self.outcome.add_done_callback(lambda _: timer.cancel())

    def _expire(self, timeout_s: float) -> None:
        """Off the loop, at the deadline: the outcome fails now (the loop runs the request here
        alone); the loop then gives the rest up."""
        err = PeerTimeout(f"the peers did not finish within the worker timeout ({timeout_s:g} s)")
        if _fail(self.outcome, err):
            self._post(self._give_up, err)

    def _give_up(self, err: BaseException) -> None:
        """The request runs here alone; a remote plan nobody else will finish is finished now."""
        _fail(self.outcome, err)
        if self.dispatch is not None and self.dispatch.plan.combine != LOCAL and not self.plan_released:
            self.plan_released = True
            self.peers.waits.submit(self.peers.pool.finish, self.dispatch.plan, [])

    def _receive(self, check: Callable[[SegmentEntry], None]) -> None:
        """Off the loop: each shipment received as it arrives and posted to the loop, then the end."""
        try:
            for entries, still_coming in self.peers.arrivals(self.dispatch, check):
                self._post(self._arrived, entries, still_coming)
        except Exception as err:  # noqa: BLE001 - the plan is finished; the request runs here alone
            self._post(self._give_up, err)
            return
        self._post(self._arrivals_done)

    def _built_here(self, building: Future) -> None:
        """The local builds are done: combine early (something comes from peers), or, with a remote
        combine node, ship this server's entries there and wait for its ``Prefill`` off the loop."""
        building.result()  # a broken build gives the peer work up
        self.built_here = True
        assert self.dispatch is not None
        plan = self.dispatch.plan
        if self.outcome.done():
            return  # timed out: the request runs here alone
        if plan.combine != LOCAL:
            shipped = self.loop.engine.cache.held_documents(self.peers.local_shipment(plan))
            self.plan_released = True  # the combine run finishes it
            remote = self.peers.waits.submit(self.peers.prefill_remotely, self.dispatch, self.request, shipped,
                                             self.built)
            self.outcome.set_result((remote, self.built))
        elif any(worker != LOCAL for worker in plan.builds) or plan.pulls:
            self._combine_early()
        self._maybe_done()

    def _arrived(self, entries: list[SegmentEntry], still_coming: int) -> None:
        """A shipment is in: its entries stored (checked), and, while more are to come, the held head
        combined again (one at a time: the next covers more). Once the outcome is done (timed out),
        late entries are ignored."""
        if self.outcome.done():
            return
        if entries:
            install_entries(self.loop.engine, entries, self.loop.mode)
        if still_coming and self.built_here:
            self._combine_early()

    def _combine_early(self) -> None:
        """The held head of the prompt combined on the loop while peers' documents are on their way,
        unless one still runs (a failed early combine only loses that head)."""
        if self.outcome.done() or (self.early is not None and not self.early.done()):
            return
        assert self.dispatch is not None
        # the first head: what this server held or built itself, whatever came in meanwhile
        arriving = self.dispatch.plan.arriving_at(LOCAL) if self.early is None else frozenset()
        if self.early is not None:
            self.built = self.built.with_head(_head(self.early))
        self.early = self.loop.precombine(self.request, self.built, arriving)
        self.early.add_done_callback(lambda _: self._post(self._maybe_done))

    def _arrivals_done(self) -> None:
        self.all_arrived = True
        self._maybe_done()

    def _maybe_done(self) -> None:
        """Every shipment in, the local builds and the last early combine done: the request is
        combined here, its stats counting the heads."""
        if self.outcome.done() or not (self.built_here and self.all_arrived):
            return
        if self.early is not None and not self.early.done():
            return  # its end posts this again
        if self.early is not None:
            self.built = self.built.with_head(_head(self.early))
        self.outcome.set_result((None, self.built))


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _fail(future: Future, err: BaseException) -> bool:
    """``future`` fails with ``err`` unless it is done already (another thread may settle it);
    whether it did."""
    try:
        future.set_exception(err)
    except InvalidStateError:
        return False
    return True


def _settle(future: Future, done: Future, value: Any) -> None:
    """``future`` holds ``value``, or the error ``done`` ended with."""
    error = done.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _head(early: Future) -> PrefillStats | None:
    """An early combine's head stats, once it is done (None if it combined nothing or failed)."""
    return None if early.exception() is not None else early.result()
