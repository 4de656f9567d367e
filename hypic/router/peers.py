"""Peer prefill for ``hypic serve --workers N``: the server process is worker 0 (its engine loop
serves every endpoint and decodes every request as with one worker); workers 1..N-1 are Ray
actors that prefill the request's cold documents alongside it. The combine node is the worker
with the best cache-aware score (``plan.combine_score``; the server on ties): the server itself
(peers ship their entries here), or a peer (everyone ships there; it runs the combine pass and
sends back the request's state, which the server decodes).

``prefill_for`` is the whole of a request's peer work, in one place: plan, dispatch, the server's own
builds (on its loop), then either receiving the peers' entries while combining early here, or
shipping this server's entries to the remote combine node; the server's loop starts it once it has
admitted the request (a slot and room for its state), the HTTP layer only hands it over."""
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray

from hypic import DEFAULT_SEPARATOR
from hypic.engine import Prefill
from hypic.prefill_stats import BuiltForRequest
from hypic.cache.segments import PromptParts
from hypic.cache.modes import Mode
from hypic.cache.plan import RequestPlan
from hypic.cache.store import SegmentEntry
from hypic.prefill_stats import PrefillStats
from hypic.server.loop import EngineLoop

from .plan import Plan, make_plan
from .pool import WorkerPool, start_ray
from .splitter import Splitter
from .transfer import ReceiveCounts, install_entries, receive_all

LOCAL = 0  # the server's own engine


@dataclass
class Dispatch:
    """A plan whose peer work has started: its build and shipment refs (see ``WorkerPool.dispatch``)."""

    plan: Plan
    mode: Mode
    builds: list[tuple[int, ray.ObjectRef]]
    shipments: list[tuple[int, ray.ObjectRef]]


class PeerPrefill:
    """Plans each request over the local engine (worker 0) and the peers, starts the peers' part,
    and brings back what the combine node needs: entries for the server, or a remote ``Prefill``."""

    def __init__(self, model: str, workers: int, *, threads: int = 1, ray_address: str | None = None,
                 seam_width: int = 8, timeout_s: float = 300.0, separator: str = DEFAULT_SEPARATOR,
                 engine_options: dict[str, Any] | None = None, transfer: str = "torch") -> None:
        if not isinstance(workers, int) or workers < 2:
            raise ValueError(f"peer prefill needs at least 2 workers, got {workers!r}")
        start_ray((workers - 1) * threads, ray_address)
        peers = list(range(1, workers))
        self.pool = WorkerPool(model, peers, threads, {**(engine_options or {}), "seam_width": seam_width}, (LOCAL,),
                               timeout_s, transfer)
        self.splitter = Splitter.for_model(model, seam_width, separator)
        if any(f != self.splitter.fingerprint for f in self.pool.fingerprints()):
            raise RuntimeError("the workers loaded a different model than the server")
        self.received = ReceiveCounts()  # entries this server received as combine node
        self.flows = ThreadPoolExecutor(32, thread_name_prefix="hypic-peer-flow")  # each waits on the loop and peers
        self.remote_prefills = ThreadPoolExecutor(8, thread_name_prefix="hypic-remote-prefill")  # waits on peers

    def prefill_for(self, loop: EngineLoop, request: RequestPlan) -> Future:
        """``_prefill_flow`` of a request the loop planned, on a thread of its own; the future holds its result."""
        return self.flows.submit(self._prefill_flow, loop, request)

    def warmup_for(self, loop: EngineLoop, documents: list[str], namespace: str = "") -> Future:
        """``_warmup_flow`` on a thread of its own; the future holds the documents' token counts."""
        return self.flows.submit(self._warmup_flow, loop, documents, namespace)

    def _prefill_flow(self, loop: EngineLoop, request: RequestPlan) -> tuple[Future | None, BuiltForRequest]:
        """A request's cold documents prefilled on the server's loop and on the peers at once.
        Documents on disk or in Mooncake are brought up first
        (held here, never rebuilt by a peer). If the server is the combine node, the peers' entries are
        stored here as they come, the held head combined early (the future is None); else the
        server's entries go to the peer that is, and the future will hold that peer's ``Prefill``.
        Also returns what was built for the request (its stats count it)."""
        engine, mode, parts = loop.engine, loop.mode, request.parts
        loaded, held = loop.call(lambda: (engine.load_from_tiers(request), frozenset(engine.store.entries))).result()
        plan = self.plan(parts, mode, held.__contains__)
        built = dataclasses.replace(self.built_for_request(plan), loaded=loaded)
        dispatch = self.dispatch(plan, mode)
        local = self.local_segments(plan)
        if local:
            loop.build(local, parts.namespace).result()
        if plan.combine == LOCAL:
            return None, self._receive_combining_early(loop, dispatch, parts, built)
        keys = self.local_shipment(plan)
        shipped = loop.call(lambda: [e for k in keys if (e := engine.store.entries.get(k)) is not None]).result()
        remote = self.remote_prefills.submit(self.prefill_remotely, dispatch, parts, request.logits_from, shipped, built)
        return remote, built

    def _receive_combining_early(self, loop: EngineLoop, dispatch: Dispatch, parts: PromptParts,
                                 built: BuiltForRequest) -> BuiltForRequest:
        """Store the peers' entries on the server as each shipment arrives; after the server's own
        builds (if anything comes from peers) and after arrivals while more are to come (one at a
        time), the loop combines the prompt's held head, so the request's combine pass overlaps the
        peers' last builds (a failed early combine only loses that head). Returns ``built`` with the
        heads' stats."""
        engine, mode, plan = loop.engine, dispatch.mode, dispatch.plan
        from_peers = any(worker != LOCAL for worker in plan.builds) or bool(plan.pulls)
        arrivals, early = self.arrivals(dispatch), [loop.precombine(parts, built)] if from_peers else []
        try:
            for entries, still_coming in arrivals:
                if entries:
                    loop.call(lambda: install_entries(engine, entries, mode)).result()
                if still_coming and (not early or early[-1].done()):  # one at a time: the next covers more
                    built = built.with_head(_head(early[-1]) if early else None)
                    early.append(loop.precombine(parts, built))
        finally:
            arrivals.close()  # a broken install: the plan's queued tokens are released now
        if early:
            built = built.with_head(_head(early[-1]))  # waits for the last one
        return built

    def _warmup_flow(self, loop: EngineLoop, documents: list[str], namespace: str = "") -> list[int]:
        """Documents (checked already, as the engine's own warm-up checks them) spread by LPT over the
        server's loop and the peers, each cached where it is built; their token counts."""
        engine, mode = loop.engine, loop.mode
        held = loop.call(lambda: frozenset(engine.store.entries)).result()
        plan, counts = self.plan_documents(documents, mode, held.__contains__, namespace)
        local = self.local_segments(plan)
        building = loop.build(local, namespace) if local else None
        self.cache(plan, mode)
        if building is not None:
            building.result()
        return counts

    def plan(self, parts: PromptParts, mode: Mode, held_locally: Callable[[str], bool],
             combine: int | None = None) -> Plan:
        """Documents the local engine holds are hits there; the rest go by LPT over every live worker,
        the request's combine pass counted on its combine node. The combine node is the best-scoring
        worker unless ``combine`` says (a warm-up: nothing is combined)."""
        jobs = self.splitter.jobs(parts, mode)
        combine_tokens = 0 if combine is not None else self.splitter.combine_tokens(parts, mode)
        with self.pool.lock:
            self.pool.index.sync(LOCAL, [job.key for job in jobs if held_locally(job.key)])
            return make_plan(jobs, self.pool.index, dict(self.pool.queued), combine=combine,
                             combine_tokens=combine_tokens)

    def plan_documents(self, documents: list[str], mode: Mode, held_locally: Callable[[str], bool],
                       namespace: str = "") -> tuple[Plan, list[int]]:
        """A warm-up's documents (in cache ``namespace``) spread by LPT over every live worker (those
        held anywhere skipped), and each document's token count."""
        parts = self.splitter.parse(self.splitter.separator.join(["", *documents, ""]), namespace)
        return self.plan(parts, mode, held_locally, combine=LOCAL), [len(segment) for segment in parts.segments]

    def cache(self, plan: Plan, mode: Mode) -> None:
        """Build the peers' part of a warm-up plan; the entries stay on the peers."""
        self.pool.cache(plan, mode)

    def flush(self, namespace: str | None = None) -> int:
        """Empty the peers' pools (``namespace``: of that cache namespace only); returns the entries they dropped."""
        return self.pool.flush(namespace)

    def local_segments(self, plan: Plan) -> list[tuple[int, ...]]:
        """The cold documents the local engine prefills itself."""
        return [job.token_ids for job in plan.builds.get(LOCAL, [])]

    def dispatch(self, plan: Plan, mode: Mode) -> Dispatch:
        """Start the peers' part of ``plan`` (their builds and pulls); returns at once."""
        builds, shipments = self.pool.dispatch(plan, mode)
        return Dispatch(plan, mode, builds, shipments)

    def arrivals(self, dispatch: Dispatch) -> Iterator[tuple[list[SegmentEntry], int]]:
        """A local-combine plan's shipments as each arrives: its entries, received point-to-point into
        buffers sized by their checked headers, and how many shipments are still to come (a failed
        transfer breaks the group and its entries are left out; a lost peer's are missing: the local
        combine pass recomputes them). The plan is finished when the iteration ends."""
        group, check, lost = self.pool.group, self.splitter.entry_check(dispatch.mode), []
        try:
            for index, shipment in enumerate(dispatch.shipments):
                received: list[SegmentEntry] = []
                for batch in self.pool.wait([shipment], lost):
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

    @staticmethod
    def built_for_request(plan: Plan) -> BuiltForRequest:
        """The documents ``plan`` builds for its request; remote: those the peers build."""
        return plan.built_for_request(LOCAL)

    def prefill_remotely(self, dispatch: Dispatch, parts: PromptParts, logits_from: int | None,
                         local_entries: list[SegmentEntry], built: BuiltForRequest) -> Prefill:
        """Blocks until the remote combine node has received every entry and run the request's
        combine pass; returns its ``Prefill`` (the state the server decodes; its stats count
        ``built`` and the heads combined early as computed for the request). Raises if the combine
        node is lost (it is forgotten; the caller prefills locally instead)."""
        return self.pool.run_on_combine(
            dispatch.plan, parts, dispatch.mode, (dispatch.builds, dispatch.shipments), built,
            lambda combine, built: combine.prefill.remote(parts, dispatch.mode, logits_from, built),
            local_entries, self.pool.timeout_s).value

    def status(self) -> dict[str, Any]:
        status = self.pool.status()
        return {**status, "workers": [LOCAL, *status["workers"]], "received_entries": dataclasses.asdict(self.received)}

    def close(self) -> None:
        """Stop waiting on peers: flows and remote prefills not started are cancelled, no more start."""
        self.flows.shutdown(wait=False, cancel_futures=True)
        self.remote_prefills.shutdown(wait=False, cancel_futures=True)

    def shutdown(self) -> None:
        """``close``, and stop the workers."""
        self.close()
        self.pool.shutdown()


def _head(early: Future) -> PrefillStats | None:
    """An early combine's head stats, once it is done (None if it combined nothing or failed)."""
    return None if early.exception() is not None else early.result()
