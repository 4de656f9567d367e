"""An engine over N tensor-parallel ranks driven from one process (``Engine.from_pretrained(...,
tp_size=N)``): this process is rank 0 and runs the lockstep engine loop a tensor-parallel server
runs (``lockstep.leader_loop``, on a thread of its own); ranks 1..N-1 follow it (``rank_group``).
``generate``, ``warmup`` and ``flush`` are requests to that loop, answered as ``Engine``'s are;
pure methods run on rank 0's engine. A rank that dies, hangs or falls out of step ends the group
within seconds: every pending and later call raises ``HypicError`` naming the cause, and this
process goes on."""
import queue
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..cache.modes import Mode
from ..engine import Engine, GenerationResult
from ..errors import HypicError, InvalidRequest, as_written
from ..parallel.group import TensorParallel
from ..prefill_stats import BuiltForRequest
from ..sampling.params import SamplingParams
from .lockstep import leader_loop
from .loop import DoneEvent, ErrorEvent, Event, default_prefill_batch
from .rank_group import start_ranks
from .requests import Completion

SERVED = ("generate", "warmup", "flush")  # run the model or change caches: through the loop, on every rank
RANK_ZERO = frozenset({"parse", "policy", "entry_bytes", "state_bytes", "check_documents", "segment_key", "plan"})  # pure
POLL_S = 0.5  # how often a waiting call looks whether the group failed
CALL_TIMEOUT_S = 3600.0  # a call not answered in this long is given up (cancelled); a hung rank fails far sooner


@dataclass(frozen=True)
class CallRequest:
    """What the loop reads of a ``generate`` call (``scheduler.requests.Request``); plain data, so rank 0's
    records carry it to the other ranks."""

    params: SamplingParams
    stream: bool = False
    logprobs: None = None
    rid: str | None = None


class EngineGroup:
    """Rank 0's ``Engine`` leading ranks 1..N-1 through the lockstep loop. ``generate``, ``warmup`` and
    ``flush`` run on every rank, in the one ``mode`` the loop serves (a server's ``--mode``); pure methods
    (``RANK_ZERO``) and attributes are rank 0's. Other methods take or hand back rank 0's own states or
    stepwise computations, which the other ranks could not follow: refused. ``threads``: torch threads per
    follower (this process keeps its own)."""

    def __init__(self, path: str | Path, tp_size: int, threads: int | None = 1, mode: Mode | str = Mode.HYPIC,
                 **options: Any) -> None:
        loop_options = {"mode": Mode.parse(mode), "max_prefill_batch": default_prefill_batch(options.get("device", "cpu"))}
        self.ranks = start_ranks(tp_size, str(path), threads, options, loop_options)
        try:
            self._engine = Engine.from_pretrained(path, tp=self.ranks.tp, **options)
        except BaseException:
            self.ranks.kill()
            dist.destroy_process_group()
            raise
        self.loop = leader_loop(self._engine, ranks=self.ranks, **loop_options)
        self.loop.start()

    @property
    def tp(self) -> TensorParallel:
        return self.ranks.tp

    @property
    def failure(self) -> str | None:
        """Why the group can no longer serve (a rank died, hung or fell out of step); None: it can."""
        return self.loop.failure

    def __getattr__(self, name: str) -> Any:
        if name == "_engine":  # not loaded (yet): no attribute to hand on
            raise AttributeError(name)
        value = getattr(self._engine, name)
        if callable(value) and not name.startswith("_") and name not in RANK_ZERO:
            raise HypicError(f"Engine.{name} is not served by a tensor-parallel engine group (its other ranks "
                             f"could not follow it); use {', '.join(SERVED)}")
        return value

    # ----- served calls -------------------------------------------------------------------
    def generate(self, prompt: str | list[int], *, mode: Mode | str | None = None,
                 built: BuiltForRequest = BuiltForRequest(), namespace: str = "", **sampling: Any) -> GenerationResult:
        """``Engine.generate`` on every rank (as one request of the loop); its result rank 0's."""
        start = time.perf_counter()
        self._check(mode)
        if built != BuiltForRequest():
            raise HypicError("Engine.generate with built= (work done for it beforehand on this rank) is not served "
                             "by a tensor-parallel engine group")
        params = SamplingParams(**sampling)
        if params.n != 1:
            raise InvalidRequest("Engine.generate makes one continuation (n = 1); the server runs n > 1")
        parts = self._engine.parse(prompt, namespace)
        sequences = self._engine.sequences(params, parts.token_ids, seed=self.loop.sample_seed())
        events: queue.Queue[Event] = queue.Queue()
        job = self.loop.submit(parts, CallRequest(params), sequences, events.put, arrived=start)
        try:
            return _result(self._completion(events))
        finally:
            job.cancel()  # given up or failed: the loop drops it (a finished one is gone already)

    def warmup(self, documents: list[str], mode: Mode | str | None = None, namespace: str = "") -> list[int]:
        """``Engine.warmup`` on every rank, in chunks among the loop's other work."""
        self._check(mode)
        return self._wait(self.loop.warmup(documents, namespace))

    def flush(self, namespace: str | None = None,
              tiers: frozenset[str] = frozenset({"memory"})) -> tuple[int, int, dict[str, int]]:
        """``Engine.flush`` on every rank; the counts are rank 0's."""
        self._check(None)
        return self._wait(self.loop.flush(namespace, tiers))

    def _check(self, mode: Mode | str | None) -> None:
        """Refuse a call the group cannot serve: it failed, or the call asks for another mode than the loop's."""
        self._raise_if_failed()
        if mode is not None and Mode.parse(mode) != self.loop.mode:
            raise HypicError(f"this tensor-parallel engine group serves mode {self.loop.mode.value}, not "
                             f"{as_written(str(mode))}: pass mode= to Engine.from_pretrained(..., tp_size=N)")

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise HypicError(f"the tensor-parallel engine group cannot go on: {self.failure}")

    def _completion(self, events: "queue.Queue[Event]") -> Completion:
        """The request's end, waiting for it; raises if it failed, the group failed, or no answer came in time."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                event = events.get(timeout=POLL_S)
            except queue.Empty:
                self._raise_if_failed()
                continue
            if isinstance(event, DoneEvent):
                return event.completion
            if isinstance(event, ErrorEvent):
                self._raise_if_failed()  # the group's cause, when it is what failed the request
                raise HypicError(event.message)
        raise HypicError(f"the tensor-parallel engine group gave no answer in {CALL_TIMEOUT_S:.0f} s")

    def _wait(self, future: Future) -> Any:
        """The future's result, waiting for it; raises if the call failed, the group failed, or it timed out."""
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                return future.result(timeout=POLL_S)
            except FutureTimeout:
                self._raise_if_failed()
            except Exception:  # the call's own error, unless the group's failure is what ended it
                self._raise_if_failed()
                raise
        raise HypicError(f"the tensor-parallel engine group gave no answer in {CALL_TIMEOUT_S:.0f} s")

    # ----- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loop on every rank and leave the group (this engine is unusable afterwards); after a
        failure the other ranks are gone already."""
        if not dist.is_initialized():
            return
        self.loop.stop()  # the stop is broadcast to the followers: they finish their writes and exit
        self._engine.close()
        self.ranks.close()

    def __enter__(self) -> "EngineGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _result(completion: Completion) -> GenerationResult:
    """``Engine.generate``'s result of a finished one-sample request."""
    (sample,) = completion.samples
    stats = completion.prefill
    return GenerationResult(sample.output_ids, sample.text, stats.prompt_tokens, stats.cached_tokens,
                            stats.recomputed_tokens, completion.ttft_s, completion.e2e_s, sample.finish_reason or "",
                            completion.mode, stats.segments_hit, stats.segments_missed, stats)
