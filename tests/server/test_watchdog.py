"""The engine loop's watchdog against a clock the test moves: a loop is overdue only when its last
beat is more than the deadline old, each beat starts the count again, and no deadline never is."""
import pytest

from hypic.scheduler.watchdog import Watchdog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_loop_is_overdue_only_past_its_deadline_since_the_last_beat() -> None:
    clock = Clock()
    dog = Watchdog(10.0, clock)
    clock.now += 10.0
    assert dog.overdue() is None  # exactly at the deadline: still within it
    clock.now += 0.5
    assert "10.5 s" in (dog.overdue() or "") and "--watchdog-timeout" in (dog.overdue() or "")
    dog.beat()
    clock.now += 9.9
    assert dog.overdue() is None and dog.since_beat() == pytest.approx(9.9)


def test_without_a_deadline_nothing_is_overdue() -> None:
    clock = Clock()
    dog = Watchdog(None, clock)
    clock.now += 1e6
    assert dog.overdue() is None


@pytest.mark.parametrize("timeout_s", [0.0, -1.0])
def test_a_deadline_that_is_not_positive_is_refused(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        Watchdog(timeout_s)
