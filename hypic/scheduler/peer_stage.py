"""The engine loop's side of a request's peer work (``hypic serve --workers N``): when it starts (once
the request holds a running slot and room for its state), what the loop waits on meanwhile, and what
it takes from it: documents built elsewhere, or the request's whole prefill from a peer. The work
itself is the router's (``hypic.router.PeerPrefill``), whose futures complete within the worker
timeout; a failure only costs speed: the request is prefilled here alone."""
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..prefill import Prefill
from ..prefill_stats import BuiltForRequest
from .jobs import Job, Pending, PeerWork, Phase
from .stats import LoopStats

log = logging.getLogger("hypic.server")


@dataclass
class PeerTask:
    """One request's peer work: what starts it (until it starts), the work under way, and what it gave."""

    start: PeerWork | None
    building: Future | None = None  # under way: (the remote Prefill's future or None, what was built)
    remote: Future | None = None  # the request's Prefill computed on a peer; None: here
    built: BuiltForRequest = field(default_factory=BuiltForRequest)  # computed for it before its prefill


class PeerStage:
    """Every request's peer work, by job. ``wake``: makes the loop run again once a future is done."""

    def __init__(self, wake: Callable[[Future], None], stats: LoopStats) -> None:
        self.wake, self.stats = wake, stats
        self.tasks: dict[Job, PeerTask] = {}

    def add(self, job: Job, work: PeerWork) -> None:
        self.tasks[job] = PeerTask(work)

    def forget(self, job: Job) -> None:
        self.tasks.pop(job, None)

    def to_start(self, job: Job) -> bool:
        """Whether ``job`` has peer work that has not started yet."""
        task = self.tasks.get(job)
        return task is not None and task.start is not None

    def start(self, job: Job) -> None:
        """Start its peer work (phase ``building``); a start that fails is that work's failure."""
        task = self.tasks[job]
        start, task.start = task.start, None
        assert start is not None
        job.phases.append(Phase.BUILDING)
        try:
            task.building = start(job.plan)
        except Exception as err:  # noqa: BLE001 - peers that cannot even start cost only speed
            task.building = Future()
            task.building.set_exception(err)
        self.wake(task.building)

    def busy(self, job: Job) -> bool:
        """Whether ``job`` waits on its peers: their builds, or its combine pass on one of them."""
        task = self.tasks.get(job)
        if task is None:
            return False
        building = task.building is not None and not task.building.done()
        return building or (task.remote is not None and job.steps is None and not task.remote.done())

    def built_now(self, waiting: Iterable[Pending]) -> list[Job]:
        """The waiting jobs whose peer work is done and not taken yet."""
        return [job for job in waiting if isinstance(job, Job) and (task := self.tasks.get(job)) is not None
                and task.building is not None and task.building.done()]

    def take(self, job: Job) -> bool:
        """Take ``job``'s finished peer work: True when its documents are in this pool now and it combines
        here; False when it runs here alone (the work failed) or its combine pass runs on a peer
        (phase ``receiving``)."""
        task = self.tasks[job]
        building, task.building = task.building, None
        assert building is not None
        try:
            task.remote, task.built = building.result(timeout=0)  # done: ``built_now`` found it so
        except Exception as err:  # noqa: BLE001 - a broken peer path must not fail the request
            self.stats.peer_prefill_failures += 1
            log.warning("peer prefill of %s failed (%s: %s); it runs on this worker alone", job.rid,
                        type(err).__name__, err)
            return False
        if task.remote is None:
            return True
        job.phases.append(Phase.RECEIVING)
        self.wake(task.remote)
        return False

    def remote_prefill(self, job: Job) -> Prefill | None:
        """The Prefill a peer computed for ``job`` (done by now); None: none, or it failed (then it is
        prefilled here)."""
        task = self.tasks.get(job)
        if task is None or task.remote is None:
            return None
        try:
            return task.remote.result(timeout=0)
        except Exception as err:  # noqa: BLE001 - a lost combine node: prefill here instead
            log.warning("remote prefill of %s failed (%s: %s); prefilling here", job.rid, type(err).__name__, err)
            return None

    def built(self, job: Job) -> BuiltForRequest:
        """What was computed for ``job`` before its prefill (documents its peers built)."""
        task = self.tasks.get(job)
        return task.built if task is not None else BuiltForRequest()
