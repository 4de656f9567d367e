"""What one iteration of the engine loop runs, and each request's way through it: which waiting work
starts (the ``SchedulingPolicy``'s order and admission; a request's reads below memory and its peers'
work waited on), one batch of prefill passes through the model, one decode step for every running
sample, and a request's end: finished, cancelled or failed. ``EngineLoop`` owns the thread, the inbox
and the state these steps work on."""
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..assembler import CombineResult, Steps
from ..engine import Engine
from ..prefill import Prefill
from ..prefill_stats import PrefillStats
from .flushes import BackgroundFlushes
from .inbox import Inbox
from .jobs import ErrorEvent, DoneEvent, Job, Pending, Phase, ProgressEvent, WarmupTask, held_bytes, input_logprobs
from .peer_stage import PeerStage
from .policy import SchedulingPolicy
from .requests import Completion, SampleResult
from .stats import LoopStats
from .sync import Solo

log = logging.getLogger("hypic.server")


class Batching:
    """The iteration's steps over the loop's state (set up by ``EngineLoop``)."""

    engine: Engine
    sync: Solo
    policy: SchedulingPolicy
    stats: LoopStats
    inbox: Inbox
    peers: PeerStage
    flushes: BackgroundFlushes
    waiting: list[Pending]
    running: list[Job]
    max_prefill_batch: int
    _republish: Callable[[], None]  # a new snapshot of the counters (``EngineLoop``'s)

    # ----- what waits -------------------------------------------------------------------------
    def _awaiting(self, job: Job) -> bool:
        """Whether it waits on work elsewhere: its reads below memory (``Solo.held_back``), or its peers."""
        return self.sync.held_back(job) or self.peers.busy(job)

    def _leave_queue(self, item: Pending) -> None:
        if item in self.waiting:
            self.waiting.remove(item)
            self.sync.left(item)
            self.inbox.gone()

    # ----- scheduling -----------------------------------------------------------------------
    def _startable(self, pending: Pending) -> bool:
        """A prefill under way continues unless it waits on peers; a new one needs a running slot and room."""
        if isinstance(pending, WarmupTask):
            return True
        if pending.admitted:
            return not self._awaiting(pending)
        return not self.sync.held_back(pending) and self._fits(pending)

    def _fits(self, job: Job, slots_ahead: int = 0, bytes_ahead: int = 0) -> bool:
        """Whether a new job gets a running slot and room for its state beside the running and admitted
        ones and what jobs ahead of it, about to start, will take (``slots_ahead``, ``bytes_ahead``)."""
        if self.flushes.holds(job.parts.namespace):
            return False  # its namespace's entries are being deleted below memory
        started = sum(1 for p in self.waiting if isinstance(p, Job) and p.admitted)
        held = held_bytes(self.waiting, self.running) + bytes_ahead
        return self.policy.admits(len(self.running) + started + slots_ahead, held, job.footprint)

    def _start_peer_work(self) -> None:
        """Admit every job with peer work that fits now, in priority order, so its peers build while
        this server runs other prefills (the prefill steps admit a job only when they reach it); the
        room a job ahead of it will take here stays that job's."""
        slots_ahead = bytes_ahead = 0
        for pending in self._by_priority():
            if not isinstance(pending, Job) or pending.admitted or self.sync.held_back(pending):
                continue
            if not self._fits(pending, slots_ahead, bytes_ahead):
                continue
            if not self.peers.to_start(pending):
                slots_ahead, bytes_ahead = slots_ahead + 1, bytes_ahead + pending.footprint
            else:
                self._admit_to_run(pending)

    def _admit_to_run(self, job: Job) -> bool:
        """The job holds its slot and room from now on; with peer work, that starts (BUILDING) and
        the job waits on it (False); else its prefill starts here (True)."""
        job.admitted = True
        if not self.peers.to_start(job):
            return True
        self.peers.start(job)
        return False

    def _take_peer_work(self) -> None:
        """Take the outcome of every job's finished peer work (``_peer_outcome``)."""
        for job in self.peers.built_now(self.waiting):
            self._guarded(job, self._peer_outcome)

    def _peer_outcome(self, job: Job) -> None:
        """Its documents built on peers are in the pool now: it ranks by what its combine pass computes."""
        if self.peers.take(job):
            job.remaining = self.engine.cache.uncached_tokens(job.plan)

    def _by_priority(self) -> list[Pending]:
        """Waiting work in the policy's order."""
        return self.policy.order(self.waiting)

    def _step_prefills(self) -> None:
        """One batch of prefill work: startable prefills and warm-ups in priority order, each resumed
        to the combine pass it asks for next, as many as fit one chunk's tokens (at least one)."""
        batch, budget = [], self.engine.chunk_tokens
        for pending in self._by_priority():
            if pending not in self.waiting or not self._startable(pending):
                continue
            if isinstance(pending, Job) and not pending.admitted and not self._admit_to_run(pending):
                continue  # its peer work just started
            if pending.work is None and not self._resume(pending, None):
                continue  # it ended (a remote prefill taken, a warm-up of cached documents) or failed
            if pending.work is None or (batch and pending.work.tokens > budget):
                continue  # a pause (its turn), or it waits for a step with room
            batch.append(pending)
            budget -= pending.work.tokens
            if budget <= 0 or len(batch) == self.max_prefill_batch:
                break
        if batch:
            self._run(batch)

    def _run(self, batch: list[Pending]) -> None:
        """The batch's combine passes in one pass through the model, each result sent back to its
        steps. If the batch fails, each pass is put back and run alone: only a failing one fails."""
        works = [p.work for p in batch if p.work is not None]
        restores = [work.checkpoint() for work in works] if len(works) > 1 else []
        start = time.perf_counter()
        try:
            results: list[CombineResult] = self.sync.model_call(lambda: self.engine.runner.run(works),
                                                                [v for p in batch for v in (p.serial, p.work.tokens)])
        except Exception as err:
            if len(batch) == 1:
                self._broke(batch[0], err)
                return
            for restore in restores:
                restore()
            for pending in batch:
                self._run([pending])
            return
        self.stats.add_pass(sum(work.tokens for work in works), time.perf_counter() - start)
        for pending, work, result in zip(batch, works, results):
            pending.remaining = self.policy.left(pending.remaining, work.tokens)
            self._resume(pending, result)

    def _resume(self, pending: Pending, reply: CombineResult | None) -> bool:
        """Send ``reply`` to the pending's steps (a job's are made at its first turn): it asks for its
        next combine pass (``pending.work``) or pauses (None), or it ends or breaks (False)."""
        if isinstance(pending, Job) and pending.steps is None:
            pending.steps = self._prefill_steps(pending)
            pending.phases.append(Phase.COMBINING)
        assert pending.steps is not None
        try:
            pending.work = pending.steps.send(reply)
            return True
        except StopIteration as done:
            pending.work = None
            self._ended(pending, done.value)
        except Exception as err:
            pending.work = None
            self._broke(pending, err)
        return False

    def _ended(self, pending: Pending, value: Any) -> None:
        if isinstance(pending, WarmupTask):
            self._leave_queue(pending)
            pending.future.set_result(value)
        else:
            self._guarded(pending, lambda job: self._prefilled(job, value))

    def _broke(self, pending: Pending, err: Exception) -> None:
        """A warm-up that breaks fails alone; a request's error fails that request."""
        if isinstance(pending, WarmupTask):
            self.sync.failed()
            self._leave_queue(pending)
            pending.future.set_exception(err)
        else:
            self._fail(pending, err)

    # ----- one request ----------------------------------------------------------------------
    def _guarded(self, job: Job, step: Callable[[Job], None]) -> None:
        """Run one job's step; an unexpected error fails that job only."""
        try:
            step(job)
        except Exception as err:
            self._fail(job, err)

    def _fail(self, job: Job, err: Exception) -> None:
        """The job ends with an error event; it hears of it even if letting go of what it holds fails."""
        log.error("request %s failed: %s: %s", job.rid, type(err).__name__, err, exc_info=err)
        self.stats.requests_failed += 1
        self.sync.failed()
        try:
            self._remove(job)
            self._release(job)
        finally:
            job.emit(ErrorEvent(f"internal error while serving the request: {type(err).__name__}: {err}"))

    def _drop_cancelled(self) -> None:
        for pending in [p for p in (*self.waiting, *self.running) if self.sync.cancelled(p)]:
            self._drop(pending)

    def _drop(self, pending: Pending) -> None:
        """A cancelled request stops (its client went away); a cancelled warm-up runs on."""
        if isinstance(pending, Job):
            self.stats.requests_cancelled += 1
            self._guarded(pending, self._stop)

    def _stop(self, job: Job) -> None:
        for sequence in job.sequences:
            sequence.abort()
        self._finish(job)

    def _prefill_steps(self, job: Job) -> Steps[Prefill]:
        """The job's remote Prefill, or its prefill here (also when the remote one failed)."""
        remote = self.peers.remote_prefill(job)
        if remote is not None:
            return remote
        return (yield from self.engine.prefiller.prefill_steps(job.plan)).for_request(self.peers.built(job))

    def _prefilled(self, job: Job, prefill: Prefill) -> None:
        """The job's prefill is done: its samples start decoding from it (the first token now)."""
        job.prefill = prefill
        self._leave_queue(job)
        self.stats.add_prefill(job.prefill.stats)
        if job.logits_from is not None and job.prefill.prompt_logits is not None:
            assert job.request.logprobs is not None
            job.input_logprobs = input_logprobs(job.parts.token_ids, job.logits_from, job.prefill.prompt_logits,
                                                job.request.logprobs.top)
        job.phases.append(Phase.DECODING)
        state = job.prefill.state  # decode grows each sample's state in place: every sample owns one
        job.states = [state] + [state.fork() for _ in job.sequences[1:]]
        for sample_state in job.states:
            sample_state.reserve(state.length + job.request.params.max_new_tokens)
        self.running.append(job)
        for index, sequence in enumerate(job.sequences):
            if not sequence.finished:
                self._accept(job, index, job.prefill.logits)
        if job.finished:
            self._finish(job)

    def _decode(self) -> None:
        rows = [(job, i) for job in self.running for i, s in enumerate(job.sequences) if not s.finished]
        states = [job.states[i] for job, i in rows]
        marks = [state.mark() for state in states]
        start = time.perf_counter()
        try:
            logits, _ = self.sync.model_call(
                lambda: self.engine.runner.decode(states, [job.sequences[i].output_ids[-1] for job, i in rows]),
                [v for (job, i), state in zip(rows, states) for v in (job.serial, i, state.length)])
        except Exception:
            for state, mark in zip(states, marks):
                state.rollback(mark)
            self._decode_one_by_one(rows)
            return
        self.stats.add_decode_step(time.perf_counter() - start)
        for row, (job, index) in enumerate(rows):
            if job in self.running:  # not failed on an earlier sample of this step
                self._guarded(job, lambda j, i=index, r=row: self._accept(j, i, logits[r]))
        self._finish_done()

    def _decode_one_by_one(self, rows: list[tuple[Job, int]]) -> None:
        """After a failed batch: each sample alone, so that only a failing request fails."""
        for job, index in rows:
            if job in self.running:
                self._guarded(job, lambda j, i=index: self._accept(j, i, self.sync.model_call(
                    lambda: self.engine.runner.decode([j.states[i]], [j.sequences[i].output_ids[-1]]),
                    [j.serial, i, j.states[i].length])[0][0]))
        self._finish_done()

    def _finish_done(self) -> None:
        for job in [job for job in self.running if job.finished]:
            self._guarded(job, self._finish)

    def _accept(self, job: Job, index: int, logits: torch.Tensor) -> None:
        """Sample ``index`` of ``job`` takes its next token from ``logits``; the client hears of it."""
        job.sequences[index].step(logits)
        self.sync.sampled(job.serial, index, job.sequences[index].output_ids[-1])
        if job.first_token_at is None:
            job.first_token_at = time.perf_counter()
        self.stats.generated_tokens += 1
        if job.request.stream:  # a non-streaming client hears only of the end
            job.emit(ProgressEvent(index, self._completion(job)))

    def _finish(self, job: Job) -> None:
        self._remove(job)
        for state in job.states:  # each sample's prompt + output, for the next turn of a conversation
            self.engine.cache.insert_finished(state, self.engine.policy(job.mode, job.parts.namespace))
        self._release(job)
        completion = self._completion(job)
        self.stats.add_finished(completion)
        self._republish()  # a client that reads the counters after its last chunk sees its request
        job.emit(DoneEvent(completion))

    @staticmethod
    def _release(job: Job) -> None:
        """The private-pool pages a finished job read may be evicted again (released here, on the
        loop thread, not whenever the HTTP side drops the job)."""
        for state in job.states:
            state.release()

    def _completion(self, job: Job) -> Completion:
        now = time.perf_counter()
        samples = [SampleResult(s.text, list(s.output_ids), s.finish_reason, s.matched_stop, list(s.logprobs))
                   for s in job.sequences]
        return Completion(
            rid=job.rid, samples=samples, prompt_ids=job.parts.token_ids,
            prefill=job.prefill.stats if job.prefill is not None else PrefillStats(),
            ttft_s=(job.first_token_at or now) - job.start, e2e_s=now - job.start, mode=job.mode,
            input_logprobs=job.input_logprobs)

    def _remove(self, job: Job) -> None:
        self.peers.forget(job)
        if job in self.running:
            self.running.remove(job)
        self._leave_queue(job)
        if job.steps is not None:
            job.steps.close()  # releases the public entries its prefill pinned
        else:
            self.engine.cache.discard_prefetch(job.plan)  # gone before it started: what was read for it is dropped
