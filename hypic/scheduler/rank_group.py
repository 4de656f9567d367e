"""The processes of a tensor-parallel server: this process is rank 0 (the HTTP server and the leading
engine loop); ranks 1..N-1 are started here, each loading its shard and following rank 0's loop
(``lockstep.FollowerLoop``). A rank that dies takes the server down: rank 0's watchdog notices it,
/health answers 503 for a moment, then the remaining ranks are killed and rank 0 exits non-zero.
A rank that hangs does too: each follower beats a heartbeat from a thread of its own (it goes on
while the rank computes or waits in a collective, both of which release the interpreter), and one
silent for ``HANG_S`` is taken for dead. A follower exits when rank 0 goes away (its broadcast
fails, or its parent process is gone)."""
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..cache.tiers.hierarchy import PrefetchPolicy
from ..parallel.group import GroupFailure, TensorParallel
from ..parallel.launch import free_address, join_group
from .fatal import exit_soon
from .lockstep import FollowerLoop

log = logging.getLogger("hypic.server")
POLL_S = 0.5  # how often the watchdog looks at the ranks' processes (and a follower at its parent)
HANG_S = 20.0  # a follower whose heartbeat is this old is hung (stopped, or stuck holding the interpreter)


def _follow(rank: int, size: int, address: str, threads: int | None, path: str, engine_options: dict[str, Any],
            loop_options: dict[str, Any], parent: int, heartbeat: Any) -> None:
    """A follower rank: join the group, load its shard, follow rank 0's loop until it stops."""
    from ..engine import Engine
    for stop in (signal.SIGINT, signal.SIGTERM):  # rank 0 ends the group (a terminal's Ctrl-C reaches every rank)
        signal.signal(stop, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), name="hypic-parent-watch", daemon=True).start()
    threading.Thread(target=_beat, args=(heartbeat,), name="hypic-heartbeat", daemon=True).start()
    if threads is not None:
        torch.set_num_threads(threads)
    tp = join_group(rank, size, address, engine_options.get("device", "cpu"))
    engine = Engine.from_pretrained(path, tp=tp, **_follower_options(engine_options))
    loop = FollowerLoop(engine, **loop_options)
    try:
        loop.run()
    except (Exception, GroupFailure) as err:  # rank 0 gone (the broadcast failed) or the ranks out of step
        print(f"hypic: tensor-parallel rank {rank} stops: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        os._exit(1)  # its peers may be stuck in a collective: nothing is closed gracefully
    engine.close()  # rank 0 stopped the server: lower tiers' writes finish
    dist.destroy_process_group()


def _follower_options(options: dict[str, Any]) -> dict[str, Any]:
    """A follower's engine options: rank 0's, except that a follower waits for each read below memory
    to finish (rank 0 decides when a request stops waiting; a follower's own copy must then be in)."""
    tiers = options.get("tiers")
    if tiers is None:
        return options
    return {**options, "tiers": dataclasses.replace(tiers, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)}


def _beat(heartbeat: Any) -> None:
    """Stamp ``heartbeat`` with the time (``time.monotonic``, one clock for every process of the host)."""
    while True:
        heartbeat.value = time.monotonic()
        time.sleep(POLL_S)


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


class RankGroup:
    """Starts ranks 1..N-1 and joins this process to the group as rank 0 (``tp``); from then on a
    watchdog thread ends the server if a rank dies. ``engine_options``: ``Engine.from_pretrained``'s
    (every rank loads with them), ``loop_options``: ``EngineLoop``'s; ``threads``: torch threads per rank."""

    def __init__(self, size: int, path: str, threads: int | None, engine_options: dict[str, Any],
                 loop_options: dict[str, Any]) -> None:
        context, address = mp.get_context("spawn"), free_address()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one host talk over loopback
        self.failed: str | None = None
        self.closing, self._lock = False, threading.Lock()
        self.heartbeats = [context.Value("d", 0.0) for _ in range(1, size)]  # 0: not beating yet
        self.processes = [context.Process(target=_follow, args=(rank, size, address, threads, path, engine_options,
                                                                loop_options, os.getpid(), self.heartbeats[rank - 1]),
                                          daemon=True)
                          for rank in range(1, size)]
        for process in self.processes:
            process.start()
        threading.Thread(target=self._watch, name="hypic-rank-watchdog", daemon=True).start()
        self.tp: TensorParallel = join_group(0, size, address, engine_options.get("device", "cpu"))

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [process.pid for process in self.processes if process.pid is not None]

    def _watch(self) -> None:
        while not self.closing:
            for rank, (process, heartbeat) in enumerate(zip(self.processes, self.heartbeats), 1):
                silent = time.monotonic() - heartbeat.value if heartbeat.value else 0.0
                if self.closing:
                    return
                if process.exitcode is not None:
                    self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) died (exit code {process.exitcode})")
                    return
                if silent > HANG_S:
                    self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) hangs (no heartbeat for "
                              f"{silent:.0f} s)")
                    return
            time.sleep(POLL_S)

    def fail(self, message: str) -> None:
        """The group cannot go on: say why (/health answers 503 with it), then kill the other ranks and
        exit non-zero (rank 0 may be stuck in a collective with the dead rank: no graceful stop)."""
        with self._lock:
            if self.failed is not None or self.closing:
                return
            self.failed = message
        exit_soon(message, before_exit=self.kill)

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=5)

    def close(self) -> None:
        """After rank 0's loop broadcast its stop: the followers finish their writes and exit."""
        self.closing = True
        for process in self.processes:
            process.join(timeout=30)
        self.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
