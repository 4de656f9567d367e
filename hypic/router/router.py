"""The router: segment-parallel prefill of a request's cold documents on Ray workers, assembled
on one combine node.

Per request: parse and plan it once, as the engines would (``hypic.planner.Planner``, no weights);
the plan goes to the combine node as it is (pickled once). The combine node is the worker
with the best cache-aware score (its cached fraction of the request, documents or a prompt prefix
it served before, against its load, see ``plan.combine_score``); cold documents go to workers by LPT, one task per
document, so each is shipped as soon as it is done while its builder computes the next; the
shipped entries travel builder -> combine node point-to-point over ``torch.distributed`` (gloo),
their headers as object refs handed to the combine node's ``install`` (``transfer="ray"``: the
whole entries through Ray's object store), never via the router; the combine node checks and stores them,
then runs the request's combine pass and decode. LPT counts that combine pass as load on the
combine node, which therefore builds less and, once its own documents are done, combines the head
of the prompt it already holds while the peers' last documents are on their way (the request then
resumes near that head's end). A builder that dies costs only its documents:
the combine pass recomputes what did not arrive, and the router forgets the worker.
"""
import time
from dataclasses import dataclass
from typing import Any

import ray

from hypic.cache.modes import Mode
from hypic.engine import GenerationResult
from hypic.planner import Planner

from .index import SegmentIndex
from .plan import Plan, document_jobs, make_plan
from .pool import WorkerPool, start_ray


class NoLiveWorkers(RuntimeError):
    """Every worker has died."""


@dataclass
class RoutedResult:
    """A request's output, where it ran, and how long each phase took (seconds, router clock)."""

    result: GenerationResult
    plan: Plan
    dispatch_s: float  # until the last cold document is prefilled on its builder
    transfer_s: float  # until the combine node has checked and stored every shipped entry
    combine_s: float  # the request on the combine node: combine pass and decode
    lost_workers: list[int]
    combined_early: int = 0  # the head of the prompt combined while documents were still arriving, and resumed


class Router:
    """N workers (Ray actors), each owning an engine; ``generate`` as ``Engine.generate`` does."""

    def __init__(self, model: str = "default", workers: int = 2, *, threads: int = 1, ray_address: str | None = None,
                 seam_width: int = 8, timeout_s: float = 300.0, engine_options: dict[str, Any] | None = None,
                 transfer: str = "torch") -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
        start_ray(workers * threads, ray_address)
        self.pool = WorkerPool(model, list(range(workers)), threads, {**(engine_options or {}), "seam_width": seam_width},
                               timeout_s=timeout_s, transfer=transfer)
        self.planner = Planner.for_model(model, seam_width)
        if any(f != self.planner.fingerprint for f in self.pool.fingerprints()):
            raise RuntimeError("the workers loaded a different model than the router split for")

    @property
    def workers(self) -> dict[int, ray.actor.ActorHandle]:
        return self.pool.workers

    @property
    def index(self) -> SegmentIndex:
        return self.pool.index

    def warmup(self, documents: list[str], worker: int, mode: Mode | str = Mode.HYPIC, namespace: str = "") -> list[str]:
        """Cache ``documents`` on one worker (as a PIC segment each, in cache ``namespace``); returns their keys."""
        jobs = document_jobs(self.planner.plan(self.planner.documents(documents, namespace), mode))
        self.pool.get(worker, self.workers[worker].build.remote(jobs, mode))
        self.pool.sync(worker)
        return [j.key for j in jobs]

    def generate(self, prompt: str, *, mode: Mode | str = Mode.HYPIC, namespace: str = "", **sampling: Any) -> RoutedResult:
        """Run ``prompt`` across the workers in cache ``namespace`` ("": shared); the output equals a
        single engine's. Each wait on a worker, the combine node's whole answer included, ends by
        ``timeout_s`` (a late worker is lost)."""
        if not self.workers:
            raise NoLiveWorkers("every worker has died")
        mode = Mode.parse(mode)
        request = self.planner.plan(self.planner.parse(prompt, namespace), mode)
        tokens = request.parts.token_ids
        with self.pool.lock:
            loads, prefixes = dict(self.pool.queued), self.pool.prefixes.matched(tokens, namespace)
        plan = make_plan(document_jobs(request), self.index, loads, prefixes=prefixes, prompt_tokens=len(tokens),
                         combine_tokens=request.recomputed_tokens())
        start = time.perf_counter()
        run = self.pool.run_on_combine(plan, request, mode, self.pool.dispatch(plan, mode),
                                       plan.built_for_request(plan.combine),
                                       lambda combine, shared, built: combine.generate.remote(shared, sampling, built))
        with self.pool.lock:  # its engine keeps the prompt's prefix in its private pool
            self.pool.prefixes.record(plan.combine, tokens, namespace)
        return RoutedResult(run.value, plan, run.built_at - start, run.gathered_at - run.built_at,
                            time.perf_counter() - run.gathered_at, run.lost, run.value.stats.combined_early_tokens)

    def shutdown(self) -> None:
        self.pool.shutdown()
