"""Worker actors on Ray and the router's bookkeeping of them: the global segment index, the tokens
queued on each, and the workers lost.

Every wait on a worker has a deadline (the pool's ``timeout_s``: ``hypic serve --worker-timeout``);
a worker that misses it is lost: forgotten, killed, and logged with the cause. The pool's lock
guards bookkeeping only: no Ray call that can wait (a get, a kill, a transfer group's rebuild) runs
under it, so a thread that plans or dispatches (the server's engine loop) never waits on a slow one."""
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError, RayActorError, RayError

import hypic
from hypic.errors import HypicError
from hypic.cache.plan import RequestPlan
from hypic.prefill_stats import BuiltForRequest, PrefillStats
from hypic.cache.modes import Mode
from hypic.cache.store import SegmentEntry

from .group import BulkGroup
from .index import SegmentIndex
from .leftovers import end_processes, processes_naming, ray_processes_below, sessions_of
from .prefix_index import PrefixIndex
from .transfer import ReceiveCounts
from .plan import PROMPT_ORDER_TOKENS, Plan
from .serialization import register_tensor_serializer
from .worker import LoopStalled, Worker

PACKAGE_ROOT = Path(hypic.__file__).resolve().parents[1]  # the folder this process imports hypic from
TRANSFERS = ("torch", "ray")  # bulk entries over torch.distributed (gloo), or through Ray's object store
MAX_CALLS = 64  # a worker's calls in flight at once (they wait on its one engine loop)
START_TIMEOUT_S = 600.0  # a worker still loading its checkpoint after this long fails the start
# a worker's longest wait on its own engine loop, in pool timeouts: past the pool's longest chain of
# waits on one call (a remote combine's early combine, builds, installs), so the pool decides first
WORKER_WAIT_FACTOR = 4.0
JOIN_TIMEOUT_S = 25.0  # a --ray-address that does not let this process join in this long fails the start (in 30 s)
CONNECT_TIMEOUT_S = 5.0  # the first check of a --ray-address: something listens there


log = logging.getLogger("hypic.router")


class WorkerStartError(RuntimeError):
    """A worker died or failed while it started (its error is in the message)."""


WorkerLost = RayActorError  # the actor died (a task that raised is a RayTaskError: its worker lives on)


_started_sessions: list[Path] = []  # session folders of the local Ray runtimes start_ray started
_starting: list[bool] = []  # a local runtime was being started here (its start may have been cut short)
RAY_TEMP_DIR = Path("/tmp/ray")  # where a local runtime keeps its sessions (Ray's default)


def start_ray(cpus: int, address: str | None) -> None:
    """Join ``address``, or start a local Ray runtime with ``cpus`` CPUs (once per process). A SIGTERM
    meanwhile reaches the caller's handler; where the caller has none, it exits as Ray's would, through
    the shutdown that ends the runtime."""
    if not ray.is_initialized():
        _exit_on_sigterm_where_unhandled()
        with _in_folder(PACKAGE_ROOT):
            if address is None:  # a runtime of its own, even where `ray start` or RAY_ADDRESS names one
                _starting[:] = [True]
                # the driver's own: Ray's C++ failure handler would turn a signal during the start into an
                # abort that leaves its daemons behind; the stop on SIGTERM is the caller's
                ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
                # on the main thread, not a helper: the daemons it starts die with the thread that started them
                with _sigterm_handler_kept():
                    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
                _started_sessions.extend(_session_started_here())
            else:
                _join(address)
    register_tensor_serializer()


def _exit_on_sigterm_where_unhandled() -> None:
    """A SIGTERM exits the process (its exit handlers end the Ray runtime) where nothing else
    handles it yet."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(signum))


@contextmanager
def _sigterm_handler_kept() -> Iterator[None]:
    """Keep Ray's start from replacing the SIGTERM handler: its own raises an exit wherever the
    signal lands, which Python drops where it lands in a finalizer, and the start goes on serving."""
    utils = ray._private.utils
    replace = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = replace


def _join(address: str) -> None:
    """Join the Ray cluster at ``address`` within ``JOIN_TIMEOUT_S``, or a ``HypicError`` naming why:
    nothing listens there, it does not answer as Ray, or it refuses this machine's auth token."""
    _reachable(address)
    joined: Future = Future()

    def join() -> None:
        try:
            ray.init(address=address, log_to_driver=False)
            joined.set_result(None)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            joined.set_exception(err)

    threading.Thread(target=join, name="hypic-ray-join", daemon=True).start()
    try:
        joined.result(timeout=JOIN_TIMEOUT_S)
    except FutureTimeout:
        raise HypicError(f"cannot join the Ray cluster at {address}: it did not answer as Ray's GCS in "
                         f"{JOIN_TIMEOUT_S:.0f} s (the head's address and port, as `ray start --head` printed them?)") from None
    except ConnectionError as err:
        if any(type(e).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(e) for e in _chain(err)):
            raise HypicError(f"cannot join the Ray cluster at {address}: it refused this machine's auth token "
                             "(Ray's token auth: give this machine the cluster's token in RAY_AUTH_TOKEN or "
                             "~/.ray/auth_token)") from err
        raise HypicError(f"cannot join the Ray cluster at {address}: {err}") from err


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and the errors it was raised from or while handling, innermost last."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__  # type: ignore[assignment]


def _reachable(address: str) -> None:
    """A TCP connection to ``host:port`` within ``CONNECT_TIMEOUT_S`` (other address forms are Ray's to read)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise HypicError(f"cannot join the Ray cluster at {address}: {err.strerror or err} "
                         "(is `ray start --head` running there, on that port?)") from None


def _session_started_here() -> list[Path]:
    """The session folder (logs, sockets, spilled objects) of the Ray runtime this process started;
    none when ``ray.init`` joined a runtime that was already running (``--ray-address``)."""
    node = getattr(ray._private.worker, "_global_node", None)
    return [Path(node.get_session_dir_path())] if node is not None and node.head else []


def stop_ray() -> None:
    """Stop the local Ray runtime ``start_ray`` started, or was starting when it was cut short, and
    delete its session folder (nothing of a runtime it joined): Ray's processes below this one that
    outlive the shutdown are ended too. Other processes' sessions, and ``session_latest`` when it
    names one, stay."""
    if not _starting:
        return
    below = ray_processes_below(os.getpid())
    ray.shutdown()
    _started_sessions.extend(s for s in sessions_of(os.getpid(), RAY_TEMP_DIR) if s not in _started_sessions)
    left = end_processes(sorted({*below, *processes_naming(_started_sessions)}))
    left += end_processes(processes_naming(_started_sessions))  # any a daemon started before it ended
    if left:
        log.warning("killed %d Ray processes left after its shutdown: %s", len(left), left)
    _starting.clear()
    while _started_sessions:
        session = _started_sessions.pop()
        for _ in range(3):  # a Ray process still exiting may write a last log line meanwhile
            shutil.rmtree(session, ignore_errors=True)
            if not session.exists():
                break
            time.sleep(0.2)
        latest = session.parent / "session_latest"
        if latest.is_symlink() and Path(os.readlink(latest)) == session:
            latest.unlink(missing_ok=True)


@contextmanager
def _in_folder(folder: Path) -> Iterator[None]:
    """Run the block in ``folder``. Ray puts the folder ``ray.init`` ran in first on its workers'
    import path: started in the folder that holds this very package, they import it, not whatever
    a ``hypic`` directory in the caller's folder holds."""
    here = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(here)


@dataclass
class RemoteRun:
    """What ``WorkerPool.run_on_combine`` brings back: the combine node's answer, when the request's
    builds were done and when its entries were all on the combine node (``time.perf_counter``), and
    the workers lost meanwhile."""

    value: Any
    built_at: float
    gathered_at: float
    lost: list[int]


class WorkerPool:
    """Actors ``ids`` (one engine each), the index of what they hold and their queued tokens.
    ``local``: ids of engines outside the pool (the server's own) that plans may name. Safe to use
    from several threads: the bookkeeping is under ``lock``, waits on Ray are not."""

    def __init__(self, model: str, ids: list[int], threads: int, options: dict[str, Any], local: tuple[int, ...] = (),
                 timeout_s: float = 300.0, transfer: str = "torch") -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.timeout_s = timeout_s  # a worker that has not answered a wait in this long is lost
        self.lock = threading.RLock()
        actor = ray.remote(num_cpus=threads, max_restarts=0, max_concurrency=MAX_CALLS)(Worker)
        # a worker's own waits end later than the pool's (which then has lost and killed it): a backstop
        self.workers = {w: actor.remote(model, threads, options, WORKER_WAIT_FACTOR * timeout_s) for w in ids}
        self._check_started()
        self.index = SegmentIndex()
        self.prefixes = PrefixIndex()  # prompt prefixes in the workers' private pools
        self.queued = {w: 0 for w in (*local, *ids)}  # tokens of cold documents dispatched, not done
        self.lost: list[int] = []
        self.build_failures = 0  # peers' builds (and fetches) that raised: their documents were recomputed
        self.group = BulkGroup(local[:1], timeout_s) if transfer == "torch" else None
        self._rebuilding = False  # a thread is rebuilding the group (outside the lock)
        self.rebuild_group_if_needed()

    def _check_started(self) -> None:
        """Wait until every worker has loaded its engine; one that cannot (it failed to import, to load
        the model) fails the start now, with its error, instead of leaving a group waiting for it."""
        try:
            ray.get([worker.fingerprint.remote() for worker in self.workers.values()], timeout=START_TIMEOUT_S)
        except (RayError, GetTimeoutError) as err:
            self.shutdown()
            raise WorkerStartError(f"a worker could not start: {err}") from err

    def fingerprints(self) -> list[str]:
        return ray.get([worker.fingerprint.remote() for worker in self.workers.values()], timeout=self.timeout_s)

    def dispatch(self, plan: Plan, mode: Mode) -> tuple[list[tuple[int, ray.ObjectRef]], list[tuple[int, ray.ObjectRef]]]:
        """One build task per cold document an actor builds (each actor's in LPT order). Returns
        every build's (worker, ref) and what goes to the combine node (peers' builds in the order
        they finish, then the pulls)."""
        priority = sum(plan.build_tokens().values())  # the request's uncached document tokens
        with self.lock:
            self._reserve(plan)
            ship_to, actors = self.destination(plan.combine), dict(self.workers)
        per_worker = {worker: [actors[worker].build.remote([j], mode, priority + rank * PROMPT_ORDER_TOKENS,
                                                           None if worker == plan.combine else ship_to)
                               for rank, j in enumerate(jobs)]
                      for worker, jobs in plan.builds.items() if worker in actors}
        pulls = [(w, actors[w].fetch.remote(keys, ship_to)) for w, keys in plan.pulls.items() if w in actors]
        builds = [(w, ref) for w, refs in per_worker.items() for ref in refs]
        rounds = max(map(len, per_worker.values()), default=0)
        shipments = [(w, refs[i]) for i in range(rounds) for w, refs in per_worker.items()
                     if i < len(refs) and w != plan.combine]
        return builds, shipments + pulls

    def install_on(self, combine: int, shipments: list[tuple[int, ray.ObjectRef]], mode: Mode,
                   extra: list[SegmentEntry] | None = None) -> list[tuple[int, ray.ObjectRef]]:
        """The combine node's install of each shipment, run as each one arrives, and of ``extra``
        entries sent from this process (point-to-point when this process is in a live group)."""
        actor = self.workers[combine]
        refs = [ref for _, ref in shipments] + ([ray.put(self.ship(extra, combine))] if extra else [])
        return [(combine, actor.install.remote(mode, ref)) for ref in refs]

    def run_on_combine(self, plan: Plan, request: RequestPlan, mode: Mode, dispatched: tuple[list, list],
                       built: BuiltForRequest, call: Callable[[Any, ray.ObjectRef, BuiltForRequest], ray.ObjectRef],
                       extra: list[SegmentEntry] | None = None, timeout_s: float | None = None) -> RemoteRun:
        """The remote-combine half of a request, one copy for the router and for the server's peers:
        everything gathered on the combine node (``gather_on_combine``), then ``call(its actor, the
        request's plan in the object store, built with the heads' stats)``, waited for (``timeout_s``:
        at most that long; None: the pool's ``timeout_s``); the plan is finished either way. The
        request's plan is pickled once for every call the combine node gets. A combine node lost or
        timed out is forgotten (killed if it timed out), and the error raised."""
        lost: list[int] = []
        combine = self.workers[plan.combine]
        try:
            shared = ray.put(request)
            built, built_at = self.gather_on_combine(plan, shared, mode, dispatched, lost, built, extra)
            gathered_at = time.perf_counter()
            value = self.get(plan.combine, call(combine, shared, built), timeout_s)
            return RemoteRun(value, built_at, gathered_at, lost)
        finally:
            self.finish(plan, lost)

    def get(self, worker: int, ref: ray.ObjectRef, timeout_s: float | None = None) -> Any:
        """``worker``'s answer ``ref``, waited for ``timeout_s`` at most (None: the pool's). A worker
        lost or late is forgotten (killed if late) and the error raised."""
        try:
            return ray.get(ref, timeout=self.timeout_s if timeout_s is None else timeout_s)
        except RayError as err:
            if _is_lost(err):
                self.forget(worker, kill=_is_late(err), cause=err)
            raise

    def gather_on_combine(self, plan: Plan, request: ray.ObjectRef, mode: Mode, dispatched: tuple[list, list],
                          lost: list[int], built: BuiltForRequest,
                          extra: list[SegmentEntry] | None = None) -> tuple[BuiltForRequest, float]:
        """Everything a remote combine node needs, brought there: each shipment of ``dispatched``
        (``dispatch``'s builds and shipments) installed as it arrives, and ``extra`` entries from this
        process; its held head combined early meanwhile; every build and install waited for (a failed
        one is recomputed there). Returns ``built`` with the heads' stats, and when the builds were done
        (``time.perf_counter``)."""
        builds, shipments = dispatched
        installs = self.install_on(plan.combine, shipments, mode, extra)
        built = self.combine_early(plan, request, builds, installs, lost, built)
        self.wait(builds, lost, builds=True)
        built_at = time.perf_counter()
        self.wait_installs(installs, lost)
        return built, built_at

    def combine_early(self, plan: Plan, request: ray.ObjectRef, builds: list[tuple[int, ray.ObjectRef]],
                      installs: list[tuple[int, ray.ObjectRef]], lost: list[int], built: BuiltForRequest) -> BuiltForRequest:
        """Once the combine node's own builds are done, and again as peers' entries arrive while some
        are still on their way, it combines the head of the prompt it holds (``Worker.precombine``;
        one call at a time, each after every arrival so far), so its combine pass overlaps the peers'
        last builds. Returns ``built`` with those heads' stats (the request's own count them)."""
        combine, deadline = self.workers.get(plan.combine), time.monotonic() + self.timeout_s
        self.wait([build for build in builds if build[0] == plan.combine], lost, builds=True)
        pending = [ref for _, ref in installs]
        if not pending or combine is None:
            return built
        # the first head: what the combine node held or built itself, whatever came in meanwhile
        last = combine.precombine.remote(request, built, plan.arriving_at(plan.combine))
        while pending:
            if not ray.wait(pending, timeout=max(0.0, deadline - time.monotonic()))[0]:
                break
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0)  # take every arrival so far
            if pending and ray.wait([last], timeout=0)[0]:
                built = built.with_head(self._head(last, deadline))
                last = combine.precombine.remote(request, built)
        return built.with_head(self._head(last, deadline))

    @staticmethod
    def _head(ref: ray.ObjectRef | None, deadline: float) -> PrefillStats | None:
        """An early combine's head stats (a failed call counts nothing: the request runs regardless)."""
        if ref is None:
            return None
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except (RayError, GetTimeoutError):
            return None

    def destination(self, worker: int) -> tuple[int, int] | None:
        """Where entries for ``worker`` go point-to-point: (rank, generation), or None (object store)."""
        return None if self.group is None else self.group.destination(worker)

    def ship(self, entries: list[SegmentEntry], worker: int) -> list[Any]:
        """This process's ``entries`` for ``worker``: sent point-to-point (parcels), or as they are."""
        destination, channel = self.destination(worker), self.group.channel if self.group else None
        if destination is None or channel is None:
            return list(entries)
        return channel.ship(entries, destination[0])

    def wait_installs(self, installs: list[tuple[int, ray.ObjectRef]], lost: list[int]) -> None:
        """Wait for the combine node's installs (see ``note_receipt``)."""
        for counts in self.wait(installs, lost, forget=False):
            self.note_receipt(counts)

    def note_receipt(self, counts: ReceiveCounts) -> None:
        """A parcel that did not arrive, or an entry a sender shipped through the object store while
        the group was live (its own end broke), breaks the group: it is rebuilt after the request."""
        if self.group is not None and self.group.live and (counts.failed or counts.object_store):
            self.group.mark_broken()

    def _reserve(self, plan: Plan) -> None:
        """Count the plan's documents as queued on their builders until ``finish``."""
        for worker, tokens in plan.build_tokens().items():
            self.queued[worker] += tokens

    def cache(self, plan: Plan, mode: Mode) -> list[int]:
        """Build the plan's documents on its actors and keep them there (a warm-up); returns the
        workers lost meanwhile."""
        with self.lock:
            self._reserve(plan)
            actors = dict(self.workers)
        refs = [(w, actors[w].cache.remote(jobs, mode)) for w, jobs in plan.builds.items() if w in actors]
        lost: list[int] = []
        self.wait(refs, lost, builds=True)
        self.finish(plan, lost)
        return lost

    def flush(self, namespace: str | None = None) -> int:
        """Empty every actor's pools and the index (``namespace``: only that cache namespace's entries,
        the index re-read from the actors); returns the entries dropped (lost workers skipped)."""
        with self.lock:
            actors = dict(self.workers)
            if namespace is None:
                self.index, self.prefixes = SegmentIndex(), PrefixIndex()
        dropped = sum(self.wait([(w, worker.flush.remote(namespace)) for w, worker in actors.items()], []))
        if namespace is not None:
            for worker in actors:
                self.sync(worker)
        return dropped

    def wait(self, refs: list[tuple[int, ray.ObjectRef]], lost: list[int], forget: bool = True,
             builds: bool = False) -> list[Any]:
        """The values of the refs that succeeded within ``timeout_s`` of the call. A dead or timed-out
        worker is forgotten (``forget``; a timed-out one is also killed) and added to ``lost``; a task
        that raised only loses its value (the combine pass recomputes it; ``builds``: the refs are
        builds or fetches of documents, and it is logged and counted in ``build_failures``)."""
        values, deadline = [], time.monotonic() + self.timeout_s
        for worker, ref in refs:
            try:
                values.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except RayError as err:
                if not _is_lost(err):
                    if builds:
                        self._build_failed(worker, err)
                elif forget and worker not in lost:
                    lost.append(worker)
                    self.forget(worker, kill=_is_late(err), cause=err)
        return values

    def _build_failed(self, worker: int, err: RayError) -> None:
        with self.lock:
            self.build_failures += 1
        log.warning("worker %d: a build failed (%s); the combine pass recomputes its document", worker, _cause(err))

    def forget(self, worker: int, kill: bool = False, cause: BaseException | None = None) -> None:
        """A lost worker leaves the bookkeeping (under the lock), then, if ``kill``, is killed (outside
        it: a kill may wait on Ray)."""
        with self.lock:
            actor = self._forget(worker)
        if actor is None:
            return
        log.warning("worker %d lost (%s)%s", worker, "no cause given" if cause is None else _cause(cause),
                    "; killed" if kill else "")
        if kill:
            try:
                ray.kill(actor)
            except Exception as err:  # noqa: BLE001 - it is forgotten either way
                log.warning("worker %d: kill failed (%s)", worker, _cause(err))

    def _forget(self, worker: int) -> Any:
        """The worker's bookkeeping dropped; its handle, or None if it was forgotten already."""
        actor = self.workers.pop(worker, None)
        if actor is not None:
            del self.queued[worker]
            self.index.forget_worker(worker)
            self.prefixes.forget_worker(worker)
            self.lost.append(worker)
            if self.group is not None:
                self.group.mark_broken()
        return actor

    def finish(self, plan: Plan, lost: list[int]) -> None:
        """Release the plan's queued tokens and re-read what its actors hold (evictions included)."""
        with self.lock:
            for worker, tokens in plan.build_tokens().items():
                if worker in self.queued:
                    self.queued[worker] -= tokens
            involved = ({plan.combine, *plan.builds, *plan.pulls} & set(self.workers)) - set(lost)
        for worker in involved:
            self.sync(worker)
        self.rebuild_group_if_needed()

    def rebuild_group_if_needed(self) -> None:
        """After a loss or a failed transfer, a new bulk-transfer group over the live members: its
        bookkeeping under the lock, the members' join (slow) outside it; one rebuild at a time (a
        thread that finds one under way leaves it to that one)."""
        with self.lock:
            if self.group is None or not self.group.needs_rebuild or self._rebuilding:
                return
            self._rebuilding = True
            rebuild = self.group.begin(self.workers)
        joined = None
        try:
            joined = self.group.join(rebuild)
        finally:
            with self.lock:
                self.group.adopt(rebuild, joined)
                self._rebuilding = False

    def sync(self, worker: int) -> None:
        """Re-read what ``worker`` holds into the index (a dead or late worker is forgotten)."""
        with self.lock:
            actor = self.workers.get(worker)
        if actor is None:
            return
        try:
            held = self.get(worker, actor.held.remote())
        except RayError as err:
            if not _is_lost(err):  # (a lost one is forgotten)
                log.warning("worker %d: could not read what it holds (%s)", worker, _cause(err))
            return
        with self.lock:
            if worker in self.workers:
                self.index.sync(worker, held)

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {"workers": sorted(self.workers), "lost_workers": list(self.lost), "indexed_entries": len(self.index),
                    "indexed_prefix_blocks": len(self.prefixes),
                    "held_entries": {w: len(self.index.keys_of(w)) for w in self.workers}, "queued_tokens": dict(self.queued),
                    "peer_build_failures": self.build_failures,
                    **(self.group.status() if self.group is not None else {"transfer": "ray object store"})}

    def shutdown(self) -> None:
        """Stop the workers, and the Ray runtime with them if ``start_ray`` started it."""
        with self.lock:
            actors = list(self.workers.values())
            self.workers.clear()
        for worker in actors:
            ray.kill(worker)
        stop_ray()


def _is_lost(err: RayError) -> bool:
    """Whether the error loses its worker: it died, did not answer in time, or its loop is stuck."""
    return isinstance(err, WorkerLost) or _is_late(err)


def _is_late(err: RayError) -> bool:
    """Whether the worker did not answer in time (it is killed): here, or its own engine loop."""
    return isinstance(err, GetTimeoutError) or isinstance(getattr(err, "cause", None), LoopStalled)


def _cause(err: BaseException) -> str:
    """An error as a log line shows it: its type and message (a task's error: its cause's)."""
    cause = getattr(err, "cause", None)
    cause = cause if isinstance(cause, BaseException) else err
    return f"{type(cause).__name__}: {cause}"

