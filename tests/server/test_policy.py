"""The scheduling policy alone, against closed-form arithmetic: the order of waiting work (tokens left
less 256 tokens per second waited), what is left after a pass, and admission by slots and bytes."""
from dataclasses import dataclass

import pytest

from hypic.scheduler.policy import URGENT, SchedulingPolicy


@dataclass
class Item:
    name: str
    remaining: float
    start: float


def test_fewer_tokens_left_first_and_urgent_work_before_all() -> None:
    items = [Item("big", 3000, 0.0), Item("small", 100, 0.0), Item("urgent", URGENT, 5.0), Item("mid", 2000, 0.0)]
    assert [i.name for i in SchedulingPolicy().order(items)] == ["urgent", "small", "mid", "big"]


@pytest.mark.parametrize(("waited", "overtakes"), [(2.0, ["short", "long", "medium"]), (0.5, ["short", "medium", "long"]),
                                                   (2.2, ["long", "short", "medium"])])
def test_a_second_waited_is_worth_256_tokens(waited: float, overtakes: list[str]) -> None:
    """600 tokens that waited ``waited`` s longer than 60 and 300: rank 600 - 256 waited against 60 and 300
    (2 s: 88, between them; 0.5 s: 472, last; 2.2 s: 36.8, first)."""
    now = 1000.0
    items = [Item("medium", 300, now), Item("short", 60, now), Item("long", 600, now - waited)]
    assert [i.name for i in SchedulingPolicy().order(items)] == overtakes


def test_the_order_does_not_depend_on_when_it_is_asked() -> None:
    """Ranking needs no clock: shifting every arrival by the same time keeps the order."""
    items = [Item(str(k), r, s) for k, (r, s) in enumerate([(500, 3.0), (40, 9.0), (300, 1.0), (41, 9.004)])]
    shifted = [Item(i.name, i.remaining, i.start + 12345.0) for i in items]
    policy = SchedulingPolicy()
    assert [i.name for i in policy.order(items)] == [i.name for i in policy.order(shifted)] == ["2", "0", "1", "3"]


@pytest.mark.parametrize(("remaining", "done", "left"), [(500, 64, 436), (50, 64, 1), (1, 64, 1), (0, 64, 0),
                                                         (URGENT, 64, URGENT)])
def test_what_is_left_after_a_pass(remaining: float, done: int, left: float) -> None:
    assert SchedulingPolicy.left(remaining, done) == left


@pytest.mark.parametrize(("slots", "held", "footprint", "admitted"), [
    (3, 0, 1, True), (4, 0, 1, False), (0, 600, 400, True), (0, 601, 400, False), (3, 999, 1, True)])
def test_a_request_starts_while_a_slot_is_free_and_its_state_fits(slots: int, held: int, footprint: int,
                                                                  admitted: bool) -> None:
    assert SchedulingPolicy(max_running=4, max_state_bytes=1000).admits(slots, held, footprint) is admitted


def test_without_a_memory_bound_only_slots_limit() -> None:
    assert SchedulingPolicy(max_running=2).admits(1, 10**15, 10**15)
    assert not SchedulingPolicy(max_running=2).admits(2, 0, 0)


@pytest.mark.parametrize("bound, footprint, fits", [(None, 10**12, True), (1000, 1000, True), (1000, 1001, False)])
def test_a_request_ever_fits_when_its_state_is_within_the_bound_alone(bound: int | None, footprint: int,
                                                                    fits: bool) -> None:
    policy = SchedulingPolicy(max_running=1, max_state_bytes=bound)
    assert policy.ever_fits(footprint) is fits
    assert policy.admits(0, 0, footprint) is fits  # the same question, asked of an empty loop
