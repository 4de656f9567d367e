"""Longest-processing-time-first assignment of cold documents to workers, and where a document
another worker holds comes from: the one dispatch rule of ``--workers`` peers and ``--dp-size``
replicas alike."""
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TypeVar

Worker = TypeVar("Worker", bound=Hashable)


def lpt_assign(costs: Sequence[int], loads: Sequence[int]) -> list[int]:
    """The worker of each job: jobs by decreasing cost, each to the worker least loaded so far
    (``loads``: the tokens already queued on each worker). Ties go to the lower worker index;
    the makespan is within 4/3 of the optimum (Graham)."""
    if not loads:
        raise ValueError("no workers to assign to")
    if any(c < 0 for c in costs) or any(load < 0 for load in loads):
        raise ValueError("costs and loads must be non-negative")
    current, assignment = list(loads), [0] * len(costs)
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        worker = min(range(len(current)), key=lambda w: (current[w], w))
        assignment[job] = worker
        current[worker] += costs[job]
    return assignment


def makespan(costs: Sequence[int], loads: Sequence[int], assignment: Sequence[int]) -> int:
    """The most loaded worker's total once every job is placed as ``assignment`` says."""
    totals = list(loads)
    for cost, worker in zip(costs, assignment):
        totals[worker] += cost
    return max(totals)


def spread_builds(costs: Sequence[int], queued: Mapping[Worker, int], combine: Worker,
                  combine_tokens: int = 0) -> dict[Worker, list[int]]:
    """Cold documents of ``costs`` tokens placed by LPT over the workers (``queued``: the tokens each
    has queued; ties to the earlier worker in its order), the combine node's load counting the
    request's own ``combine_tokens``: worker -> the indices into ``costs`` it builds, in order."""
    workers = list(queued)
    loads = [queued[w] + (combine_tokens if w == combine else 0) for w in workers]
    shares: dict[Worker, list[int]] = {}
    for index, slot in enumerate(lpt_assign(costs, loads)):
        shares.setdefault(workers[slot], []).append(index)
    return shares


def least_queued(holders: Iterable[Worker], queued: Mapping[Worker, int]) -> Worker:
    """The least queued of ``holders`` (ties: the lowest): of a document's holders, the one that sends
    it; of the replicas without a hot document, the one it is copied to."""
    return min(holders, key=lambda w: (queued[w], w))
