"""The ranks of a tensor-parallel engine loop: rank 0 (this process) runs ``lockstep.leader_loop``;
ranks 1..N-1, started here (``hypic.parallel.ranks.RankGroup``: processes, heartbeat, watchdog),
each load their shard and follow rank 0's loop (``lockstep.follow_rank_zero``). Both drivers start
them here: ``hypic serve --tp-size`` (a failure ends the server) and a library's
``Engine.from_pretrained(tp_size=N)`` (a failure ends the group; the process goes on)."""
import dataclasses
from typing import Any

from ..cache.tiers.hierarchy import PrefetchPolicy
from ..engine import Engine
from ..parallel.group import TensorParallel
from ..parallel.ranks import OnFailure, RankGroup, end_ranks
from .lockstep import follow_rank_zero


def follow_loop(tp: TensorParallel, path: str, engine_options: dict[str, Any], loop_options: dict[str, Any]) -> None:
    """A follower rank's life: load its shard, follow rank 0's loop until it stops, finish its writes."""
    engine = Engine.from_pretrained(path, tp=tp, **_follower_options(engine_options))
    follow_rank_zero(engine, **loop_options)
    engine.close()  # rank 0 stopped the loop: lower tiers' writes finish


def _follower_options(options: dict[str, Any]) -> dict[str, Any]:
    """A follower's engine options: rank 0's, except that a follower waits for each read below memory
    to finish (rank 0 decides when a request stops waiting; a follower's own copy must then be in)."""
    tiers = options.get("tiers")
    if tiers is None:
        return options
    return {**options, "tiers": dataclasses.replace(tiers, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)}


def start_ranks(size: int, path: str, threads: int | None, engine_options: dict[str, Any],
                loop_options: dict[str, Any], on_failure: OnFailure = end_ranks) -> RankGroup:
    """Ranks 1..N-1 started, each loading its shard with ``engine_options`` (``Engine.from_pretrained``'s)
    and following with ``loop_options`` (``EngineLoop``'s); this process joins as rank 0. ``threads``:
    torch threads per follower; ``on_failure``: what a failed group does (``RankGroup``)."""
    return RankGroup(size, follow_loop, (path, engine_options, loop_options), threads,
                     engine_options.get("device", "cpu"), on_failure)
