"""What the holdings feed costs a request, against the number of documents a replica holds.

A replica holds ``--held`` documents (in memory, and with ``--disk`` also in a disk tier's index);
each request stores two new documents and evicts two old ones (a full pool at steady state). Timed
per request: the replica's work to tell its holdings and the ingress's to apply them to its index.

- this tree: the replica's ``HoldingsLog`` is told each store and drop as it happens (four calls),
  and an ingress reads what is new (``since``) and applies it;
- ``--baseline REV`` (a git worktree of that commit, run in a process of its own): its
  ``HoldingsFeed`` diffs everything it follows against the cache at each request's end
  (``changes``) and the ingress applies the result.

The cache is a stand-in without tensors (its keys, namespaces, token counts and, for the disk, the
real address digest and an index lookup under a lock, as ``StorageTiers.tiers_holding`` does), so a
real cache's diff would cost no less. One thread, no model: absolute times are this machine's.

    python eval/bench_holdings.py [--held 10000 100000] [--requests 30] [--baseline REV] [--json OUT]
"""
import argparse
import hashlib
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worktrees import checkout, remove

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 1000


@dataclass(frozen=True)
class Held:
    key: str
    namespace: str
    token_ids: tuple[int, ...]


class StandInCache:
    """The part of ``HybridCache`` a holdings feed reads: documents in memory, and a disk tier's index."""

    def __init__(self, held: int, disk: bool) -> None:
        self.memory = {f"doc-{i}": Held(f"doc-{i}", "", (0,) * TOKENS) for i in range(held)}
        self.disk = {self._address(key) for key in self.memory} if disk else None
        self.lock, self.next = threading.Lock(), held

    @staticmethod
    def _address(key: str) -> str:
        return "shared/" + hashlib.sha256(f"{key}|torch.bfloat16|torch.float32".encode()).hexdigest()

    def request(self) -> tuple[list[str], list[str]]:
        """Two documents stored (also on disk), the two oldest evicted from memory: their keys."""
        stored = [f"doc-{self.next}", f"doc-{self.next + 1}"]
        self.next += 2
        evicted = []
        for _ in range(2):
            evicted.append(next(iter(self.memory)))
            del self.memory[evicted[-1]]
        for key in stored:
            self.memory[key] = Held(key, "", (0,) * TOKENS)
            if self.disk is not None:
                self.disk.add(self._address(key))
        return stored, evicted

    # ----- what HoldingsFeed (the baseline) reads -------------------------------------------------
    def document_keys(self) -> frozenset[str]:
        return frozenset(self.memory)

    def held_documents(self, keys: list[str]) -> list[Held]:
        return [self.memory[key] for key in keys if key in self.memory]

    def lower_tiers_of(self, key: str, namespace: str) -> list[str]:
        if self.disk is None:
            return []
        address = self._address(key)
        with self.lock:
            return ["disk"] if address in self.disk else []

    def public_fill(self) -> float:
        return 1.0


def _timed_requests(cache: StandInCache, requests: int, tell: Any) -> list[float]:
    times = []
    for _ in range(requests):
        stored, evicted = cache.request()
        start = time.perf_counter()
        tell(stored, evicted)
        times.append(time.perf_counter() - start)
    return times


def measure_log(held: int, disk: bool, requests: int) -> dict[str, Any]:
    """This tree: the log told of each change, an ingress reading and applying what is new."""
    from hypic.cluster.holdings import HoldingsLog
    from hypic.cluster.index import DocumentIndex

    cache, index = StandInCache(held, disk), DocumentIndex()
    log = HoldingsLog("r0", cache.public_fill, capacity=1 << 16)
    for key in cache.memory:
        log.stored(key, "", "device", TOKENS)
        if disk:
            log.stored(key, "", "disk", TOKENS)
    start = time.perf_counter()
    dump = log.since(None)
    index.apply(dump)
    dump_s = time.perf_counter() - start
    after = (dump.incarnation, dump.seq)

    def tell(stored: list[str], evicted: list[str]) -> None:
        nonlocal after
        for key in stored:  # what the pool and the disk writer call as they store
            log.stored(key, "", "device", TOKENS)
            if disk:
                log.stored(key, "", "disk", TOKENS)
        for key in evicted:
            log.removed(key, "", "device")
        log.mark()  # what the request's answer carries
        told = log.since(after)
        assert index.apply(told) and told.events
        after = (told.incarnation, told.seq)

    times = _timed_requests(cache, requests, tell)
    return {"held": held, "disk": disk, "feed": "log", "per_request_s": times, "dump_s": dump_s,
            "index_documents": index.documents()}


def measure_diff(held: int, disk: bool, requests: int) -> dict[str, Any]:
    """The baseline tree: its feed diffs everything followed at each request's end."""
    from hypic.cluster.index import DocumentIndex
    from hypic.cluster.replica import HoldingsFeed

    cache, index = StandInCache(held, disk), DocumentIndex()
    feed = HoldingsFeed(cache, "r0")  # type: ignore[arg-type]
    index.apply(feed.dump())

    def tell(stored: list[str], evicted: list[str]) -> None:
        assert index.apply(feed.changes())

    times = _timed_requests(cache, requests, tell)
    return {"held": held, "disk": disk, "feed": "diff", "per_request_s": times, "index_documents": index.documents()}


def _measure_here(held: int, disk: bool, requests: int) -> dict[str, Any]:
    try:
        import hypic.cluster.holdings  # noqa: F401
    except ImportError:
        return measure_diff(held, disk, requests)
    return measure_log(held, disk, requests)


def _measure_in(tree: Path, held: int, disk: bool, requests: int) -> dict[str, Any]:
    """One measurement in a process that imports ``tree``'s package (and this script)."""
    code = (f"import sys, json; sys.path[:0] = [{str(tree)!r}, {str(ROOT / 'eval')!r}]; import bench_holdings as b; "
            f"print(json.dumps(b._measure_here({held}, {disk}, {requests})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--baseline", help="a commit whose holdings feed is measured beside this tree's")
    parser.add_argument("--json", type=Path, help="write every request's time here")
    args = parser.parse_args()
    trees = {"this tree": ROOT} | ({f"baseline {args.baseline}": checkout(args.baseline)} if args.baseline else {})
    try:
        runs = _runs(args, trees)
    finally:
        for tree in trees.values():
            if tree != ROOT:
                remove(tree)
    from hypic.evaluation.cluster import machine
    report = {"machine": machine(), "python": platform.python_version(), "requests": args.requests, "runs": runs}
    if args.baseline:
        print("\nbaseline / this tree, per request:")
        for held in args.held:
            for disk in (False, True):
                mine, base = (next(r for r in runs if r["held"] == held and r["disk"] == disk and r["tree"] == t)
                              for t in trees)
                print(f"  {held:>7} held, disk {str(disk):5}: {base['median_s'] / mine['median_s']:8.0f}x")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def _runs(args: argparse.Namespace, trees: dict[str, Path]) -> list[dict[str, Any]]:
    runs = []
    for held in args.held:
        for disk in (False, True):
            for name, tree in trees.items():
                run = _measure_in(tree, held, disk, args.requests)
                runs.append({"tree": name, **run, "median_s": statistics.median(run["per_request_s"])})
                print(f"{name:>24} | {held:>7} held | disk {str(disk):5} | {run['feed']:4} | "
                      f"median {runs[-1]['median_s'] * 1e3:9.3f} ms a request", flush=True)
    return runs


if __name__ == "__main__":
    main()
