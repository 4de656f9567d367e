"""LPT dispatch against the exact optimum (brute force) and against round-robin."""
import itertools
import random

import pytest

from hypic.router import lpt_assign, makespan


def _optimum(costs: list[int], workers: int) -> int:
    return min(makespan(costs, [0] * workers, list(a)) for a in itertools.product(range(workers), repeat=len(costs)))


def _round_robin(costs: list[int], workers: int) -> list[int]:
    return [i % workers for i in range(len(costs))]


@pytest.mark.parametrize("seed", range(40))
def test_lpt_within_graham_bound_of_optimum(seed: int) -> None:
    rng = random.Random(seed)
    workers = rng.choice([2, 3])
    costs = [rng.randint(1, 3000) for _ in range(rng.randint(1, 7))]
    lpt = makespan(costs, [0] * workers, lpt_assign(costs, [0] * workers))
    best = _optimum(costs, workers)
    assert best <= lpt <= (4 / 3 - 1 / (3 * workers)) * best + 1e-9


def test_lpt_counts_queued_tokens() -> None:
    """A worker with 5000 tokens queued gets nothing while the others are lighter."""
    assert lpt_assign([1000, 900, 800], [5000, 0, 0]) == [1, 2, 2]
    assert lpt_assign([], [3, 1]) == []


def test_lpt_beats_round_robin_on_uneven_documents() -> None:
    """Two long documents among short ones: round-robin stacks both long ones on worker 0."""
    costs = [4000, 200, 4000, 200, 300, 250]
    assert makespan(costs, [0, 0], lpt_assign(costs, [0, 0])) == 4500
    assert makespan(costs, [0, 0], _round_robin(costs, 2)) == 8300
    rng = random.Random(0)
    ratios = []
    for _ in range(200):
        uneven = [int(rng.lognormvariate(6, 1.2)) + 1 for _ in range(rng.randint(4, 16))]
        lpt = makespan(uneven, [0] * 4, lpt_assign(uneven, [0] * 4))
        ratios.append(makespan(uneven, [0] * 4, _round_robin(uneven, 4)) / lpt)
    assert min(ratios) >= 0.99 and sum(ratios) / len(ratios) > 1.2


def test_lpt_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        lpt_assign([1], [])
    with pytest.raises(ValueError):
        lpt_assign([-1], [0])
