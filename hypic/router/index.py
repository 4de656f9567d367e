"""The global segment index: which worker holds which document interior (public-pool entry)."""
from collections import defaultdict


class SegmentIndex:
    """Entry key -> the workers believed to hold it. Updated on insert (a worker built or installed
    an entry) and on eviction (a worker's report of what it still holds). It may be stale between
    reports; keys are content addresses and installs are verified, so a stale hit costs a
    recompute, never a wrong entry."""

    def __init__(self) -> None:
        self._holders: dict[str, set[int]] = defaultdict(set)

    def record(self, worker: int, keys: list[str]) -> None:
        for key in keys:
            self._holders[key].add(worker)

    def holders(self, key: str) -> set[int]:
        return set(self._holders.get(key, ()))

    def keys_of(self, worker: int) -> set[str]:
        return {key for key, workers in self._holders.items() if worker in workers}

    def sync(self, worker: int, held: list[str]) -> None:
        """Replace what ``worker`` is believed to hold with its own report (evictions drop out)."""
        kept = set(held)
        for key in [k for k, workers in self._holders.items() if worker in workers and k not in kept]:
            self._forget(worker, key)
        self.record(worker, held)

    def forget_worker(self, worker: int) -> None:
        """A dead or removed worker holds nothing."""
        for key in [k for k, workers in self._holders.items() if worker in workers]:
            self._forget(worker, key)

    def _forget(self, worker: int, key: str) -> None:
        self._holders[key].discard(worker)
        if not self._holders[key]:
            del self._holders[key]

    def __len__(self) -> int:
        return len(self._holders)
