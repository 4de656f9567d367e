"""An engine over N tensor-parallel ranks driven from one process: this process is rank 0, and every
call made on it is first sent to ranks 1..N-1 (spawned here), which make the same call on their own
shard of the model and caches. ``Engine.from_pretrained(..., tp_size=N)`` returns one, handing it
the loader every rank runs (this package sits below the engine and never imports it)."""
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import HypicError
from .group import GroupFailure, TensorParallel, from_rank_zero, same_on_every_rank
from .launch import free_address, join_group

STOP = None  # the call that ends a follower
REPEATED = frozenset({"generate", "prefill", "warmup", "flush"})  # run the model or change caches: every rank
RANK_ZERO = frozenset({"parse", "policy", "entry_bytes", "state_bytes", "check_documents", "segment_key"})  # pure


Load = Callable[..., Any]  # load(path, tp=..., **options) -> that rank's engine (``Engine.from_pretrained``)


def _follow(rank: int, size: int, address: str, threads: int | None, load: Load, path: str,
            options: dict[str, Any]) -> None:
    """A follower rank: load its shard, then repeat every call rank 0 sends until told to stop."""
    if threads is not None:
        torch.set_num_threads(threads)
    tp = join_group(rank, size, address)
    engine = load(path, tp=tp, **options)
    try:
        while (call := from_rank_zero()) is not STOP:
            name, args, kwargs = call
            error = _call(engine, name, args, kwargs)
            if not same_on_every_rank([error is not None], tp, "an engine call's outcome"):  # one rank failed alone
                where = f"here alone:\n{error}" if error is not None else "on another rank alone"
                print(f"hypic: tensor-parallel rank {rank}: Engine.{name} failed {where}", file=sys.stderr, flush=True)
                os._exit(1)  # out of step: rank 0 raises, and sees this rank gone at its next call
    finally:
        engine.close()
        dist.destroy_process_group()


def _call(engine: Any, name: str, args: tuple, kwargs: dict) -> str | None:
    """Make one call rank 0 sent; its traceback if it raised (rank 0 raises the same error from the
    same call and reports it), else None."""
    try:
        getattr(engine, name)(*args, **kwargs)
    except Exception:
        return traceback.format_exc()
    return None


class EngineGroup:
    """Rank 0's ``Engine`` whose calls that run the model or change the caches (``REPEATED``: their
    arguments are plain data) are repeated on every other rank, in the same order; pure ones
    (``RANK_ZERO``) run on rank 0 alone. Attributes are rank 0's. Other methods take or hand back
    rank 0's own states or stepwise computations, which the other ranks could not follow: refused.
    ``load``: how each rank loads its engine, importable by name (a spawned follower unpickles it)."""

    def __init__(self, load: Load, path: str | Path, tp_size: int, threads: int | None = 1, **options: Any) -> None:
        context, address = mp.get_context("spawn"), free_address()
        self._broken = False
        self._followers = [context.Process(target=_follow, args=(rank, tp_size, address, threads, load, str(path),
                                                                 options), daemon=True) for rank in range(1, tp_size)]
        for process in self._followers:
            process.start()
        try:  # this process keeps its own torch threads: they are the caller's
            self._engine = load(path, tp=join_group(0, tp_size, address), **options)
        except BaseException:
            self._stop_followers()
            raise

    @property
    def tp(self) -> TensorParallel:
        return self._engine.model.config.tensor_parallel

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._engine, name)
        if not callable(value) or name.startswith("_") or name in RANK_ZERO:
            return value
        if name not in REPEATED:
            raise HypicError(f"Engine.{name} is not served by a tensor-parallel engine driven from one process "
                             f"(its other ranks could not follow it); use {', '.join(sorted(REPEATED))}, or run "
                             "every rank's engine yourself (hypic.parallel.launch.run_ranks)")

        def repeated(*args: Any, **kwargs: Any) -> Any:
            self._check_followers()
            try:
                from_rank_zero((name, args, kwargs))
                try:
                    result = value(*args, **kwargs)
                except Exception:
                    self._agree(name, failed=True)
                    raise
                self._agree(name, failed=False)
            except GroupFailure as err:  # a rank is gone (it failed mid-call, out of step with this one)
                self._broken = True
                raise HypicError(f"Engine.{name}: a tensor-parallel rank failed or left during the call ({err}); "
                                 "the engine group cannot go on") from err
            return result
        return repeated

    def _agree(self, name: str, failed: bool) -> None:
        """Every rank failed the call or none did; else the ranks are out of step (the other ranks'
        next collective would wait forever): the followers exit and this raises."""
        if not same_on_every_rank([failed], self.tp, "an engine call's outcome"):
            self._broken = True
            raise HypicError(f"Engine.{name} failed on {'rank 0 alone' if failed else 'another rank alone'}: "
                             "the tensor-parallel ranks are out of step and the engine group cannot go on")

    def _check_followers(self) -> None:
        if self._broken:
            raise HypicError("the engine group's ranks fell out of step on an earlier call; it cannot go on")
        dead = [rank for rank, process in enumerate(self._followers, 1) if process.exitcode is not None]
        if dead:
            raise HypicError(f"tensor-parallel rank(s) {dead} have exited; the engine group cannot go on")

    def close(self) -> None:
        """Stop the other ranks and leave the group (this engine is unusable afterwards)."""
        if not dist.is_initialized():
            return
        try:
            if not self._broken:
                self._check_followers()
                from_rank_zero(STOP)
        finally:
            self._engine.close()
            dist.destroy_process_group()
            self._stop_followers()

    def _stop_followers(self) -> None:
        for process in self._followers:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()

    def __enter__(self) -> "EngineGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

