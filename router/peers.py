"""Peer prefill for ``hypic serve --workers N``: the server process is worker 0 and the combine
node of every request (its engine loop serves every endpoint as with one worker); workers 1..N-1
are Ray actors that prefill the request's cold documents alongside it and ship their entries."""
from collections.abc import Callable
from typing import Any

from hypic import DEFAULT_SEPARATOR
from hypic.engine import Engine
from hypic.segments import PromptParts
from hypic.store import SegmentEntry

from .plan import Plan, make_plan
from .pool import WorkerPool, entries_of, start_ray
from .splitter import Splitter
from .transfer import install_entries

LOCAL = 0  # the server's own engine


class PeerPrefill:
    """Plans each request over the local engine and the peers (LPT over all N, combine node local)
    and collects what the peers build or hold."""

    def __init__(self, model: str, workers: int, *, threads: int = 1, ray_address: str | None = None,
                 seam_width: int = 8, timeout_s: float = 300.0, separator: str = DEFAULT_SEPARATOR,
                 engine_options: dict[str, Any] | None = None) -> None:
        if not isinstance(workers, int) or workers < 2:
            raise ValueError(f"peer prefill needs at least 2 workers, got {workers!r}")
        start_ray((workers - 1) * threads, ray_address)
        peers = list(range(1, workers))
        self.pool = WorkerPool(model, peers, threads, {**(engine_options or {}), "seam_width": seam_width}, (LOCAL,),
                               timeout_s)
        self.splitter = Splitter.for_model(model, seam_width, separator)
        if any(f != self.splitter.fingerprint for f in self.pool.fingerprints()):
            raise RuntimeError("the workers loaded a different model than the server")

    def plan(self, parts: PromptParts, mode: str, held_locally: Callable[[str], bool]) -> Plan:
        """Documents the local engine holds are hits there; the rest go by LPT over every live worker."""
        jobs = self.splitter.jobs(parts, mode)
        with self.pool.lock:
            self.pool.index.sync(LOCAL, [job.key for job in jobs if held_locally(job.key)])
            return make_plan(jobs, self.pool.index, dict(self.pool.queued), combine=LOCAL)

    def plan_documents(self, documents: list[str], mode: str, held_locally: Callable[[str], bool]) -> Plan:
        """A warm-up's documents, spread by LPT over every live worker (those held anywhere skipped)."""
        parts = self.splitter.parse(self.splitter.separator.join(["", *documents, ""]))
        return self.plan(parts, mode, held_locally)

    def cache(self, plan: Plan, mode: str) -> None:
        """Build the peers' part of a warm-up plan; the entries stay on the peers."""
        self.pool.cache(plan, mode)

    def flush(self) -> int:
        """Empty the peers' pools; returns the entries they dropped."""
        return self.pool.flush()

    def local_segments(self, plan: Plan) -> list[tuple[int, ...]]:
        """The cold documents the local engine prefills itself."""
        return [job.token_ids for job in plan.builds.get(LOCAL, [])]

    def collect(self, plan: Plan, mode: str) -> list[SegmentEntry]:
        """Blocks until every peer's part of ``plan`` is in: the entries it built or held (a lost
        peer's are missing: the local combine pass recomputes them)."""
        builds, shipments = self.pool.dispatch(plan, mode)
        lost: list[int] = []
        try:
            self.pool.wait(builds, lost)
            return entries_of(self.pool.wait(shipments, lost, forget=False))
        finally:
            self.pool.finish(plan, lost)

    @staticmethod
    def install(engine: Engine, entries: list[SegmentEntry], mode: str) -> list[str]:
        """Store ``entries`` in the local engine's public pool (run on its loop thread)."""
        return install_entries(engine, entries, mode)[0]

    def status(self) -> dict[str, Any]:
        status = self.pool.status()
        return {**status, "workers": [LOCAL, *status["workers"]]}

    def shutdown(self) -> None:
        self.pool.shutdown()
