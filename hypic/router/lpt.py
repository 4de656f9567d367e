"""Longest-processing-time-first assignment of cold documents to workers."""
from collections.abc import Sequence


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
