"""What the engine loop holds and hands back: a request inside it (``Job``) and its phases, a warm-up
or any other prefill work (``WarmupTask``), a command run on the loop thread, the events a request's
client hears, and the numbers the loop reports about what it holds."""
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from ..assembler import CombineWork, Steps
from ..cache.modes import Mode
from ..cache.plan import RequestPlan
from ..cache.segments import PromptParts
from ..cache.store import Load
from ..errors import HypicError
from ..prefill import Prefill
from ..sampling.sequence import Sequence, TokenLogprob, token_logprob
from ..state import RequestState, tensor_bytes
from .requests import Completion, Request


class QueueFull(HypicError):
    """The waiting queue holds ``max_queued`` requests already (the app answers 503)."""


class LoopStopped(HypicError):
    """The engine loop has stopped after a fault and serves nothing more (the app answers 503)."""


@dataclass
class ProgressEvent:
    """Sample ``index`` took a token (``completion`` is the request as it stands)."""

    index: int
    completion: Completion


@dataclass
class DoneEvent:
    completion: Completion


@dataclass
class ErrorEvent:
    """The request ended without an answer: ``message`` says why. ``busy``: it was refused for lack of
    room, not failed (a client is told 503 and to retry)."""

    message: str
    busy: bool = False


Event = ProgressEvent | DoneEvent | ErrorEvent


def input_logits_from(request: Request, prompt_tokens: int) -> int | None:
    """The first prompt position whose logits the request needs (input logprobs), or None."""
    return None if request.logprobs is None else request.logprobs.input_from(prompt_tokens)


PeerWork = Callable[[RequestPlan], Future]  # starts a request's peer work on its plan, on the loop thread; the future: (remote Prefill future or None, built)


class Phase(StrEnum):
    """Where a request stands in the loop. A request with peers is admitted (room for its state) before
    anything is built or shipped for it; without peers it goes from QUEUED to COMBINING."""

    QUEUED = "queued"  # waiting for a running slot and room for its state memory
    BUILDING = "building"  # admitted; its documents built here and on peers, their entries arriving
    RECEIVING = "receiving"  # its combine pass runs on a peer; the state is on its way here
    COMBINING = "combining"  # its prefill on this loop (documents missed, the combine pass), in chunks
    DECODING = "decoding"


@dataclass(eq=False)
class Job:
    """A request inside the loop: its prompt, its samples, and where its events go."""

    rid: str
    parts: PromptParts
    request: Request
    mode: Mode
    sequences: list[Sequence]
    emit: Callable[[Event], None]
    plan: RequestPlan  # what its prefill reuses (``Engine.plan``), worked out when it is submitted
    cancelled: threading.Event = field(default_factory=threading.Event)
    start: float = field(default_factory=time.perf_counter)
    steps: Steps[Prefill] | None = None
    work: CombineWork | None = None  # the combine pass its steps asked for, not run yet
    prefill: Prefill | None = None
    states: list[RequestState] = field(default_factory=list)  # one per sample, once prefilled
    first_token_at: float | None = None
    input_logprobs: list[TokenLogprob | None] | None = None
    remaining: int = 0  # about how many prompt tokens its prefill still computes
    footprint: int = 0  # bytes of state its samples may hold (prompt + max_new_tokens each)
    # reads below memory started as it arrived (documents, its resume point), each with until when
    # (time.monotonic) it waits for them before it starts
    loads: list[Load] = field(default_factory=list)
    admitted: bool = False  # it holds a running slot and its state memory
    serial: int = -1  # its number in the loop's order of arrival (the ranks' records name it by this)
    phases: list[Phase] = field(default_factory=lambda: [Phase.QUEUED])  # every phase it entered, in order

    @property
    def phase(self) -> Phase:
        return self.phases[-1]

    def holds(self, now: float) -> list[float]:
        """Until when (``time.monotonic``) each read it is still held back for runs; none once admitted."""
        return [] if self.admitted else [until for future, until in self.loads if not future.done() and now < until]

    def cancel(self) -> None:
        """Safe from any thread: the loop drops the job at its next iteration."""
        self.cancelled.set()

    @property
    def logits_from(self) -> int | None:
        """The first prompt position whose logits it needs (input logprobs), as its plan worked out once."""
        return self.plan.logits_from

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)


@dataclass(eq=False)
class WarmupTask:
    """Documents to cache (or a request's head to combine early), run in chunks between decode
    steps like a prefill."""

    steps: Steps[Any]
    remaining: int
    future: Future = field(default_factory=Future)
    work: CombineWork | None = None
    start: float = field(default_factory=time.perf_counter)
    footprint: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    serial: int = -1  # its number in the loop's order of arrival
    source: tuple[str, list[Any], str] | None = None  # ("warmup" | "build", documents or segments, namespace)


Pending = Job | WarmupTask


@dataclass
class Command:
    """Quick work (a flush) run on the loop thread between iterations."""

    run: Callable[[], Any]
    future: Future = field(default_factory=Future)


@dataclass
class FlushCommand(Command):
    """A flush of ``namespace`` (None: every one) in ``tiers``, named so that a lockstep loop's other
    ranks make it too (a closure cannot be sent); ``flushed`` holds its counts once every tier is
    done (a loop alone empties the tiers below memory on a thread of their own, after ``run``)."""

    namespace: str | None = None
    tiers: frozenset[str] = frozenset()
    flushed: Future = field(default_factory=Future)


def wake_only() -> None:
    """A command that does nothing: it wakes the loop (a load or a peer's work finished)."""


def abandon(item: "Pending | Command", message: str) -> None:
    """Tell whoever waits on ``item`` that the loop stopped (``message``)."""
    if isinstance(item, Job):
        item.emit(ErrorEvent(message))
        return
    waiters = [item.future, item.flushed] if isinstance(item, FlushCommand) else [item.future]
    for future in waiters:
        if not future.done():
            future.set_exception(LoopStopped(message))


def input_logprobs(prompt_ids: list[int], start: int, logits: torch.Tensor, top: int) -> list[TokenLogprob | None]:
    """Logprob of each prompt token from position ``start`` (None for the first: nothing before it
    is scored), from the logits [len - start, vocab] at positions start..len-1."""
    scored = [token_logprob(logits[i - start - 1], prompt_ids[i], top) for i in range(start + 1, len(prompt_ids))]
    return [None, *scored]


def held_bytes(waiting: Iterable[Pending], running: Iterable[Job]) -> int:
    """State memory that running and admitted requests may hold."""
    admitted = sum(p.footprint for p in waiting if isinstance(p, Job) and p.admitted)
    return sum(job.footprint for job in running) + admitted


def queued_load(waiting: Iterable[Pending], running: Iterable[Job]) -> dict[str, int]:
    """What a router would count as this loop's load: prompt tokens its waiting work still prefills,
    requests it holds, and tokens its requests may still decode (their max_new_tokens budgets)."""
    waiting, running = list(waiting), list(running)
    queued = sum(int(p.remaining) for p in waiting if math.isfinite(p.remaining) and p.remaining > 0)
    decode = sum(max(0, s.params.max_new_tokens - len(s.output_ids)) for job in running for s in job.sequences
                 if not s.finished)
    return {"queued_prefill_tokens": queued, "requests": len(running) + sum(isinstance(p, Job) for p in waiting),
            "decode_tokens": decode}


def by_phase(pendings: Iterable[Pending]) -> dict[str, int]:
    """Requests by phase."""
    counts = {phase.value: 0 for phase in Phase}
    for job in pendings:
        if isinstance(job, Job):
            counts[job.phase.value] += 1
    return counts


def shared_bytes(running: Iterable[Job]) -> int:
    """Bytes of the KV blocks running requests read without owning them (private-pool pages, prompts
    their samples share), each counted once."""
    blocks = {k.data_ptr(): tensor_bytes(k, v) for job in running for s in job.states for k, v in s.shared_blocks()}
    return sum(blocks.values())


def state_bytes(running: Iterable[Job]) -> dict[str, int]:
    """Bytes of the running requests' states, in full-attention and linear layers and in sliding windows."""
    states = [s for job in running for s in job.states]
    return {"full": sum(s.nbytes - s.window_nbytes for s in states), "sliding_window": sum(s.window_nbytes for s in states)}
