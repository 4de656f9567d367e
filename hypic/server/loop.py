"""The engine loop: one thread owns the Engine; HTTP handlers talk to it through messages.

Each iteration advances the oldest waiting request's prefill by one unit (a cold segment, or the
combine pass), then decodes one token for every running request in one batch (continuous
batching: requests join and leave between iterations). Cancelled requests are dropped at the next
iteration; their pinned entries are released by closing their prefill.
"""
import queue
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from ..decode import decode_batch
from ..engine import Engine, Prefill
from ..sampling import sample
from ..segments import PromptParts
from ..state import RequestState
from .protocol import Completion, GenerationRequest
from .stats import LoopStats


@dataclass
class TokenEvent:
    """New output: the full text and ids so far, and the text added since the last event."""

    text: str
    output_ids: list[int]
    delta: str


@dataclass
class DoneEvent:
    completion: Completion


@dataclass
class ErrorEvent:
    message: str


Event = TokenEvent | DoneEvent | ErrorEvent


@dataclass(eq=False)
class Job:
    """A request inside the loop: its prompt, sampling state, and where its events go."""

    rid: str
    parts: PromptParts
    request: GenerationRequest
    mode: str
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    start: float = field(default_factory=time.perf_counter)
    steps: Generator[None, None, Prefill] | None = None
    prefill: Prefill | None = None
    state: RequestState | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    first_token_at: float | None = None
    generator: torch.Generator | None = None

    def cancel(self) -> None:
        """Safe from any thread: the loop drops the job at its next iteration."""
        self.cancelled.set()


@dataclass
class Command:
    """Work other than a generation (warmup, flush) run on the loop thread between iterations."""

    run: Callable[[], Any]
    future: Future = field(default_factory=Future)


class EngineLoop:
    """Owns ``engine`` on a background thread; ``submit`` and ``call`` are safe from any thread."""

    def __init__(self, engine: Engine, mode: str, max_running: int = 64) -> None:
        self.engine, self.mode, self.max_running = engine, mode, max_running
        self.inbox: queue.Queue[Job | Command | None] = queue.Queue()
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.stats = LoopStats()
        self.snapshot: dict[str, Any] = self._publish()
        self._thread = threading.Thread(target=self._main, name="hypic-engine-loop", daemon=True)

    # ----- other threads --------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=30)

    def submit(self, parts: PromptParts, request: GenerationRequest, emit: Callable[[Event], None]) -> Job:
        job = Job(f"hypic-{uuid.uuid4().hex[:16]}", parts, request, self.mode, emit)
        self.inbox.put(job)
        return job

    def call(self, run: Callable[[], Any]) -> Future:
        """Run ``run`` on the loop thread; the future holds its result or exception."""
        command = Command(run)
        self.inbox.put(command)
        return command.future

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ----- loop thread ----------------------------------------------------------------------
    def _main(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            if not self._drain(block=not (self.waiting or self.running)):
                return
            self._drop_cancelled()
            if self.waiting and len(self.running) < self.max_running:
                self._guarded(self.waiting[0], self._advance_prefill)
            if self.running:
                self._decode()
            self.snapshot = self._publish()

    def _drain(self, block: bool) -> bool:
        """Take everything queued (waiting for the first item when idle); False on shutdown."""
        try:
            item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, Command):
                self._run_command(item)
            else:
                self.waiting.append(item)
                self.stats.requests_received += 1
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _run_command(self, command: Command) -> None:
        try:
            command.future.set_result(command.run())
        except Exception as err:  # handed to the caller, who reports it
            command.future.set_exception(err)

    def _guarded(self, job: Job, step: Callable[[Job], None]) -> None:
        """Run one job's step; an unexpected error fails that job only."""
        try:
            step(job)
        except Exception as err:
            self._fail(job, err)

    def _fail(self, job: Job, err: Exception) -> None:
        traceback.print_exc()
        self._remove(job)
        self.stats.requests_failed += 1
        job.emit(ErrorEvent(f"internal error while serving the request: {type(err).__name__}: {err}"))

    def _drop_cancelled(self) -> None:
        for job in [j for j in (*self.waiting, *self.running) if j.cancelled.is_set()]:
            self._finish(job, "abort", None)
            self.stats.requests_cancelled += 1

    def _advance_prefill(self, job: Job) -> None:
        if job.steps is None:
            job.steps = self.engine.prefill_steps(job.parts, job.mode)
        try:
            next(job.steps)
            return
        except StopIteration as done:
            job.prefill = done.value
        self.waiting.popleft()
        self.stats.add_prefill(job.prefill.stats)
        job.state = job.prefill.state
        if job.request.params.seed is not None:
            job.generator = torch.Generator().manual_seed(job.request.params.seed)
        self.running.append(job)
        if job.request.params.max_new_tokens == 0:
            self._finish(job, "length", None)
        else:
            self._accept(job, job.prefill.logits)

    def _decode(self) -> None:
        jobs = list(self.running)
        try:
            logits, states = decode_batch(self.engine.model, [j.state for j in jobs], [j.output_ids[-1] for j in jobs])
        except Exception as err:
            for job in jobs:
                self._fail(job, err)
            return
        for b, job in enumerate(jobs):
            job.state = states[b]
            self._guarded(job, lambda j, row=logits[b]: self._accept(j, row))

    def _accept(self, job: Job, logits: torch.Tensor) -> None:
        """Sample the next token from ``logits``, stream it, and finish the job if it is done."""
        params = job.request.params
        token = sample(logits, params, job.generator)
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        job.output_ids.append(token)
        if job.request.return_logprob:
            job.logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
        self.stats.generated_tokens += 1
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.engine.eos_token_ids):
            self._finish(job, "stop", token)
            return
        text = self.engine.tokenizer.decode(job.output_ids)
        matched = next((s for s in job.request.stop if s in text), None)
        if matched is not None:
            job.text = text[: text.index(matched)]
            self._finish(job, "stop", matched)
            return
        stable = text if not text.endswith("\ufffd") else job.text  # hold back a partial character
        if len(stable) > len(job.text):
            job.emit(TokenEvent(stable, list(job.output_ids), stable[len(job.text):]))
            job.text = stable
        if len(job.output_ids) >= params.max_new_tokens or job.state.length + 1 >= self.engine.model.config.max_position_embeddings:
            self._finish(job, "length", None)

    def _finish(self, job: Job, reason: str, matched: int | str | None) -> None:
        self._remove(job)
        if job.state is not None:
            self.engine.remember(job.state, job.mode)
        if not isinstance(matched, str):  # a stop string already cut the text; a stop token is not shown
            job.text = self.engine.tokenizer.decode(job.output_ids[:-1] if reason == "stop" else job.output_ids)
        completion = self._completion(job, reason, matched)
        self.stats.add_finished(completion)
        job.emit(DoneEvent(completion))

    def _completion(self, job: Job, reason: str, matched: int | str | None) -> Completion:
        stats = job.prefill.stats if job.prefill is not None else None
        now = time.perf_counter()
        return Completion(
            rid=job.rid, text=job.text, output_ids=list(job.output_ids), finish_reason=reason, matched_stop=matched,
            prompt_tokens=len(job.parts.token_ids), cached_tokens=stats.cached_tokens if stats else 0,
            recomputed_tokens=stats.recomputed_tokens if stats else 0,
            prefix_hit_tokens=stats.prefix_hit_tokens if stats else 0, segments_hit=stats.segments_hit if stats else 0,
            segments_missed=stats.segments_missed if stats else 0, combine_tokens=stats.combine_tokens if stats else 0,
            ttft_s=(job.first_token_at or now) - job.start, e2e_s=now - job.start, mode=job.mode,
            output_logprobs=list(job.logprobs))

    def _remove(self, job: Job) -> None:
        if job in self.running:
            self.running.remove(job)
        if job in self.waiting:
            self.waiting.remove(job)
        if job.steps is not None:
            job.steps.close()  # releases the public entries its prefill pinned

    def _publish(self) -> dict[str, Any]:
        """A consistent copy of the numbers the HTTP side reports (read without locks)."""
        store, prefix = self.engine.store, self.engine.prefix_cache
        return {
            **self.stats.as_dict(), "waiting_requests": len(self.waiting), "running_requests": len(self.running),
            "public_pool": {"bytes": store.nbytes, "budget_bytes": store.budget_bytes, "entries": len(store),
                            "hits": store.hits, "misses": store.misses, "evictions": store.evictions,
                            "rejected": store.rejected, "pinned": sum(1 for k in store.pins if k in store.entries)},
            "private_pool": {"bytes": prefix.nbytes, "budget_bytes": prefix.budget_bytes, "hits": prefix.hits,
                             "misses": prefix.misses, "evictions": prefix.evictions},
        }
