"""Peer prefill for ``hypic serve --workers N``: the server process is worker 0 (its engine loop
serves every endpoint and decodes every request as with one worker); workers 1..N-1 are Ray
actors that prefill the request's cold documents alongside it. The combine node is the worker
with the best cache-aware score (``plan.combine_score``; the server on ties): the server itself
(peers ship their entries here), or a peer (everyone ships there; it runs the combine pass and
sends back the request's state, which the server decodes)."""
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from hypic import DEFAULT_SEPARATOR
from hypic.engine import Engine, Prefill
from hypic.prefill_stats import BuiltForRequest
from hypic.cache.segments import PromptParts
from hypic.cache.store import SegmentEntry

from .plan import Plan, make_plan
from .pool import WorkerLost, WorkerPool, start_ray
from .splitter import Splitter
from .transfer import ReceiveCounts, install_entries, receive_all

LOCAL = 0  # the server's own engine


@dataclass
class Dispatch:
    """A plan whose peer work has started: its build and shipment refs (see ``WorkerPool.dispatch``)."""

    plan: Plan
    mode: str
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

    def plan(self, parts: PromptParts, mode: str, held_locally: Callable[[str], bool],
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

    def plan_documents(self, documents: list[str], mode: str, held_locally: Callable[[str], bool],
                       namespace: str = "") -> tuple[Plan, list[int]]:
        """A warm-up's documents (in cache ``namespace``) spread by LPT over every live worker (those
        held anywhere skipped), and each document's token count."""
        parts = self.splitter.parse(self.splitter.separator.join(["", *documents, ""]), namespace)
        return self.plan(parts, mode, held_locally, combine=LOCAL), [len(segment) for segment in parts.segments]

    def cache(self, plan: Plan, mode: str) -> None:
        """Build the peers' part of a warm-up plan; the entries stay on the peers."""
        self.pool.cache(plan, mode)

    def flush(self, namespace: str | None = None) -> int:
        """Empty the peers' pools (``namespace``: of that cache namespace only); returns the entries they dropped."""
        return self.pool.flush(namespace)

    def local_segments(self, plan: Plan) -> list[tuple[int, ...]]:
        """The cold documents the local engine prefills itself."""
        return [job.token_ids for job in plan.builds.get(LOCAL, [])]

    def dispatch(self, plan: Plan, mode: str) -> Dispatch:
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
        plan, lost = dispatch.plan, []
        combine = self.pool.workers[plan.combine]
        installs = self.pool.install_on(plan.combine, dispatch.shipments, dispatch.mode, local_entries)
        try:
            built = self.pool.combine_early(plan, parts, dispatch.mode, dispatch.builds, installs, lost, built)
            self.pool.wait(dispatch.builds, lost)
            self.pool.wait_installs(installs, lost)
            return ray.get(combine.prefill.remote(parts, dispatch.mode, logits_from, built), timeout=self.pool.timeout_s)
        except (WorkerLost, GetTimeoutError):
            self.pool.forget(plan.combine, kill=True)
            raise
        finally:
            self.pool.finish(plan, lost)

    @staticmethod
    def install(engine: Engine, entries: list[SegmentEntry], mode: str) -> list[str]:
        """Store ``entries`` in the local engine's public pool (run on its loop thread)."""
        return install_entries(engine, entries, mode)[0]

    def status(self) -> dict[str, Any]:
        status = self.pool.status()
        return {**status, "workers": [LOCAL, *status["workers"]], "received_entries": dataclasses.asdict(self.received)}

    def shutdown(self) -> None:
        self.pool.shutdown()
