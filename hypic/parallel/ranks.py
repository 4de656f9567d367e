"""The processes of a tensor-parallel group driven from one process: this process is rank 0; ranks
1..N-1 are started here, each running ``follow(tp, *args)`` (importable by name: a spawned rank
unpickles it) until rank 0 tells it to stop. One failure rule for every driver: a rank that dies,
or hangs, ends the group within seconds, its cause named. Rank 0's watchdog notices a rank whose
process exited, or whose heartbeat is ``HANG_S`` old (each follower beats from a thread of its own,
which goes on while the rank computes or waits in a collective: both release the interpreter), and
hands the cause to the group's ``on_failure`` rule: a server exits (``hypic.scheduler.fatal``), a
library's process kills the other ranks and goes on (``end_ranks``). A follower exits when rank 0
goes away (its parent process is gone, or the collective it waits in fails) or hangs (rank 0's watchdog
beats a heartbeat the followers read: one ``HANG_S`` old means rank 0 is stopped or stuck holding the
interpreter)."""
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import HypicError, as_written
from .group import GroupFailure, TensorParallel
from .launch import free_address, join_group

log = logging.getLogger("hypic.parallel")
POLL_S = 0.5  # how often the watchdog looks at the ranks' processes (and a follower at its parent)
HANG_S = 20.0  # a follower whose heartbeat is this old is hung (stopped, or stuck holding the interpreter)
HANG_ENV = "HYPIC_RANK_HANG_S"
LAST_WORDS_BYTES = 1024  # room for the error a follower stops with

Follow = Callable[..., None]  # follow(tp, *args): a follower's whole life in the group, returning once told to stop
Kill = Callable[[], None]
OnFailure = Callable[[str, Kill], None]  # (why the group cannot go on, kill the other ranks)


def hang_s() -> float:
    """How old a heartbeat means its rank hangs: ``HYPIC_RANK_HANG_S``, else ``HANG_S``. An environment
    variable so that every rank, which inherits it, judges rank 0 by the same bound."""
    text = os.environ.get(HANG_ENV, "")
    try:
        seconds = float(text) if text else HANG_S
    except ValueError:
        raise HypicError(f"{HANG_ENV} must be a number of seconds, got {as_written(text)}") from None
    if not seconds >= 2 * POLL_S:
        raise HypicError(f"{HANG_ENV} must be at least {2 * POLL_S:g} s (two heartbeats), got {text}")
    return seconds


def end_ranks(message: str, kill: Kill) -> None:
    """A library's failure rule: the other ranks are killed at once (rank 0 may be stuck in a collective
    with the one that failed: killing them ends it); this process goes on, its group marked failed."""
    log.error("%s: the tensor-parallel group ends", message)
    kill()


def _follower(rank: int, size: int, address: str, threads: int | None, device: str, follow: Follow, args: tuple,
              parent: int, heartbeat: Any, last_words: Any, leader_beat: Any) -> None:
    """A follower rank: beat, watch the parent, join the group, run ``follow`` until it returns; if that
    raises, the error goes to ``last_words`` (rank 0's watchdog names it) and the rank exits."""
    for stop in (signal.SIGINT, signal.SIGTERM):  # rank 0 ends the group (a terminal's Ctrl-C reaches every rank)
        signal.signal(stop, signal.SIG_IGN)
    threading.Thread(target=_watch_rank_zero, args=(parent, leader_beat), name="hypic-rank-zero-watch",
                     daemon=True).start()
    threading.Thread(target=_beat, args=(heartbeat,), name="hypic-heartbeat", daemon=True).start()
    if threads is not None:
        torch.set_num_threads(threads)
    tp = join_group(rank, size, address, device)
    try:
        follow(tp, *args)
    except (Exception, GroupFailure) as err:  # rank 0 gone (the broadcast failed) or the ranks out of step
        cause = f"{type(err).__name__}: {err}"
        last_words.value = cause.encode()[:LAST_WORDS_BYTES - 1]
        print(f"hypic: tensor-parallel rank {rank} stops: {cause}", file=sys.stderr, flush=True)
        os._exit(1)  # its peers may be stuck in a collective: nothing is closed gracefully
    dist.destroy_process_group()


def _beat(heartbeat: Any) -> None:
    """Stamp ``heartbeat`` with the time (``time.monotonic``, one clock for every process of the host)."""
    while True:
        heartbeat.value = time.monotonic()
        time.sleep(POLL_S)


def _watch_rank_zero(parent: int, leader_beat: Any) -> None:
    """Exit once rank 0 (this process's parent) is gone, or its heartbeat is ``HANG_S`` old."""
    limit = hang_s()
    while os.getppid() == parent:
        silent = time.monotonic() - leader_beat.value
        if silent > limit:
            print(f"hypic: tensor-parallel rank 0 (pid {parent}) hangs (no heartbeat for {silent:.0f} s): "
                  "this rank stops", file=sys.stderr, flush=True)
            break
        time.sleep(POLL_S)
    os._exit(1)


class RankGroup:
    """Starts ranks 1..N-1, each running ``follow(tp, *args)``, and joins this process to the group as
    rank 0 (``tp``); from then on a watchdog thread fails the group if a rank dies or hangs.
    ``threads``: torch threads per follower (this process keeps its own: they are the caller's);
    ``on_failure``: what failing does, told the cause and how to kill the other ranks."""

    def __init__(self, size: int, follow: Follow, args: tuple, threads: int | None, device: str = "cpu",
                 on_failure: OnFailure = end_ranks) -> None:
        context, address = mp.get_context("spawn"), free_address()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one host talk over loopback
        self.hang_s = hang_s()  # a bad value is refused before any rank starts
        self.failed: str | None = None
        self.closing, self._lock, self.on_failure = False, threading.Lock(), on_failure
        self.closed = False
        self.heartbeats = [context.Value("d", 0.0) for _ in range(1, size)]  # 0: not beating yet
        self.last_words = [context.Array("c", LAST_WORDS_BYTES) for _ in range(1, size)]
        self.leader_beat = context.Value("d", time.monotonic())  # rank 0's, stamped by its watchdog
        self.processes = [context.Process(target=_follower, args=(rank, size, address, threads, device, follow, args,
                                                                  os.getpid(), self.heartbeats[rank - 1],
                                                                  self.last_words[rank - 1], self.leader_beat),
                                          daemon=True)
                          for rank in range(1, size)]
        for process in self.processes:
            process.start()
        threading.Thread(target=self._watch, name="hypic-rank-watchdog", daemon=True).start()
        # the watchdog's word ends rank 0's wait for the others: a follower that died before joining
        # would otherwise hold the rendezvous for its whole timeout (300 s)
        self.tp: TensorParallel = join_group(0, size, address, device, check=self._raise_if_failed)

    def _raise_if_failed(self) -> None:
        """``GroupFailure`` once the group failed (a follower died or hangs)."""
        if self.failed is not None:
            raise GroupFailure(self.failed)

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [process.pid for process in self.processes if process.pid is not None]

    def _watch(self) -> None:
        while not self.closed and self.failed is None:
            self.leader_beat.value = time.monotonic()  # while closing too: the followers finish their writes
            cause = None if self.closing else self._cause()
            if cause is not None:
                self.fail(cause)
                return
            time.sleep(POLL_S)

    def _cause(self) -> str | None:
        """Why a follower can no longer go on (it exited, or its heartbeat is old); None: all are well."""
        for rank, (process, heartbeat) in enumerate(zip(self.processes, self.heartbeats), 1):
            silent = time.monotonic() - heartbeat.value if heartbeat.value else 0.0
            if self.closing:
                return None
            if process.exitcode is not None:
                words = self.last_words[rank - 1].value.decode(errors="replace")
                return (f"tensor-parallel rank {rank} (pid {process.pid}) died (exit code {process.exitcode})"
                        + (f": {words}" if words else ""))
            if silent > self.hang_s:
                return f"tensor-parallel rank {rank} (pid {process.pid}) hangs (no heartbeat for {silent:.0f} s)"
        return None

    def fail(self, message: str) -> None:
        """The group cannot go on: remember why (the first cause), and apply the failure rule."""
        with self._lock:
            if self.failed is not None or self.closing:
                return
            self.failed = message
        self.on_failure(message, self.kill)

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=5)

    def close(self) -> None:
        """After rank 0 told the followers to stop: they finish their writes and exit."""
        self.closing = True
        for process in self.processes:
            process.join(timeout=30)
        self.kill()
        self.closed = True
        if dist.is_initialized():
            dist.destroy_process_group()



def run_as_rank_zero(fn: Follow, size: int, *args: Any, threads: int | None = 1, device: str = "cpu") -> Any:
    """``fn(tp, *args)`` on every rank of a new group: ranks 1..N-1 started here (``RankGroup``, a
    library's failure rule), rank 0 in this process; returns rank 0's result. A rank that dies, hangs
    or stops on an error fails rank 0's collective: this raises ``GroupFailure`` naming that rank and
    its cause. Rank 0's own error is raised as it is, the other ranks killed."""
    group = RankGroup(size, fn, args, threads, device)
    try:
        result = fn(group.tp, *args)
    except (Exception, GroupFailure) as err:
        cause = _named_failure(group, err) if isinstance(err, GroupFailure) else None
        group.kill()  # followers waiting for rank 0 in a collective would wait for gloo's timeout
        group.close()
        if cause is None:
            raise
        raise GroupFailure(cause) from err
    group.close()
    return result


def _named_failure(group: RankGroup, err: GroupFailure) -> str:
    """Why rank 0's collective failed: the watchdog's cause (a rank that died or hangs; given a moment,
    since the collective may fail before the watchdog's next look), else the collective's own error."""
    deadline = time.monotonic() + 4 * POLL_S
    while group.failed is None and time.monotonic() < deadline:
        time.sleep(POLL_S / 5)
    return group.failed or str(err)
