"""Start the ranks of a tensor-parallel group: one process per rank, joined over torch.distributed
(gloo on the CPU, NCCL on GPUs), each running the same function on its own share of the model."""
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..net import free_port
from .group import TensorParallel

POLL_S = 0.5  # how often a waiting launcher looks for a rank that died


def free_address() -> str:
    """A TCP rendezvous address on this host nothing listens on right now."""
    return f"tcp://127.0.0.1:{free_port()}"


def join_group(rank: int, size: int, address: str, device: str = "cpu", timeout_s: float = 300,
               check: Callable[[], None] = lambda: None) -> TensorParallel:
    """Join this process to the group as ``rank`` of ``size`` (blocks until every rank has joined).
    Rank 0 hosts the rendezvous and waits for the others in polls, calling ``check`` between them (it
    raises to give up: a rank that died before joining would hold the rendezvous for ``timeout_s``);
    once all are there, the group forms at once."""
    import datetime
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if rank == 0:
        _await_ranks(store, size, time.monotonic() + timeout_s, check)
    else:
        store.set(f"hypic/joined/{rank}", "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TensorParallel(rank, size)


def _await_ranks(store: Any, size: int, deadline: float, check: Callable[[], None]) -> None:
    """Rank 0: poll until ranks 1..size-1 have reached the rendezvous, or ``check`` raises, or ``deadline``."""
    keys = [f"hypic/joined/{rank}" for rank in range(1, size)]
    while not store.check(keys):
        check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not all reach the rendezvous in time ({size} expected)")
        time.sleep(POLL_S / 5)


def _rank_main(rank: int, size: int, address: str, threads: int | None, fn: Callable[..., Any], args: tuple,
               results: Any) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        tp = join_group(rank, size, address)
        # pickled by value: torch would share a tensor through a descriptor the parent fetches from this
        # process, which may have exited by then (FileNotFoundError / ConnectionResetError in the parent)
        results.put((rank, True, pickle.dumps(fn(tp, *args))))
    except BaseException as err:  # the caller re-raises it with the rank's traceback
        results.put((rank, False, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, threads: int | None = 1,
              timeout_s: float = 600) -> list[Any]:
    """``fn(tp, *args)`` on ``size`` new processes, one per rank (``fn`` must be importable by name);
    returns each rank's result in rank order, or raises ``RuntimeError`` with the first failing
    rank's traceback. ``threads``: torch threads per rank."""
    context = mp.get_context("spawn")
    results, address = context.Queue(), free_address()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of one host talk over loopback
    processes = [context.Process(target=_rank_main, args=(rank, size, address, threads, fn, args, results),
                                 daemon=True) for rank in range(size)]
    for process in processes:
        process.start()
    try:
        return _collect(results, processes, size, timeout_s)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _collect(results: Any, processes: list, size: int, timeout_s: float) -> list[Any]:
    """Each rank's result; a rank that dies without one (killed, out of memory) fails the group at once
    (the others would wait for it in their next collective)."""
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < size:
        try:
            rank, ok, value = results.get(timeout=POLL_S)
        except queue.Empty:
            _check_alive(processes, got, deadline)
            continue
        if not ok:
            time.sleep(POLL_S)  # a peer's death is often what failed this rank: name it first
            _check_alive(processes, got, deadline)
            raise RuntimeError(f"tensor-parallel rank {rank} failed: {value}")
        got[rank] = pickle.loads(value)
    return [got[rank] for rank in range(size)]


def _check_alive(processes: list, got: dict[int, Any], deadline: float) -> None:
    """Fail the group for a rank that died without a result. A rank killed or failing (non-zero exit)
    is named first: a rank that exited cleanly has its result, or its failure, still on the queue
    (a peer's death often is what ended it), and it is read at the next poll."""
    exited = [(rank, process) for rank, process in enumerate(processes)
              if rank not in got and process.exitcode is not None]
    for rank, process in sorted(exited, key=lambda item: item[1].exitcode == 0):
        if process.exitcode != 0 or time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel rank {rank} died (exit code {process.exitcode}) without a result")
    if time.monotonic() > deadline:
        raise RuntimeError(f"tensor-parallel ranks {sorted(set(range(len(processes))) - set(got))} gave no result in time")
