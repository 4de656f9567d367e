"""The pools' memory under churn: the arenas against the code before them.

Each pool gets a stream of inserts far larger than its budget, with a real model's shapes
(Qwen3-Next-80B-A3B: 36 Gated DeltaNet layers, state [32, 128, 128] fp32 and conv window [3, 8192];
12 attention layers, 2 KV heads of 256, bf16). Private pool: requests of a shared 1,024-token system
prompt (one of 8) and a tail of 200..2,000 tokens, inserted with snapshots at the prompt's end and
the request's. Public pool: documents of 300..1,500 tokens, each (T_C, S_C|0) per linear layer and
its interior KV. Every request's and document's tensors are fresh allocations, as the engine's are.

Measured in child processes, one per code version (this checkout, and ``--before REV`` checked out
in a temporary worktree; glibc's default malloc settings, what a server runs with): the RSS once the
pool first filled its budget, its peak and its end over the churn (growth after filling is what
fragmentation costs), the median time per insert, and the pool's own byte count. Ratios are taken
in one run. Absolute times are this CPU's.

    python eval/bench_pool_memory.py [--before 3ab1021] [--inserts 120] [--json OUT]
"""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LINEAR, ATTENTION = 36, 12
STATE, CONV = (32, 128, 128), (3, 8192)
KV_HEADS, HEAD_DIM = 2, 256


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fresh(*shape: int, dtype: Any = None) -> Any:
    """A new tensor, every page of it touched (its content does not matter here)."""
    import torch
    return torch.full(shape, 0.5, dtype=dtype or torch.float32)


def _request(rng: random.Random, serial: int) -> tuple[Any, dict]:
    """A request's state (system prompt ``serial % 8``, a random tail) and its two snapshots."""
    import torch
    from hypic.state import AttentionLayerState, LinearLayerState, RequestState

    system, tail = 1024, rng.randint(200, 2000)
    length = system + tail
    linear = [LinearLayerState(_fresh(*STATE), _fresh(*CONV)) for _ in range(LINEAR)]
    attention = [AttentionLayerState(_fresh(KV_HEADS, length, HEAD_DIM, dtype=torch.bfloat16),
                                     _fresh(KV_HEADS, length, HEAD_DIM, dtype=torch.bfloat16)) for _ in range(ATTENTION)]
    ids = [serial % 8] * system + [rng.randrange(100, 50000) for _ in range(tail)]
    state = RequestState([*linear, *attention], length, ids)
    at_system = {i: LinearLayerState(_fresh(*STATE), _fresh(*CONV)) for i in range(LINEAR)}
    return state, {system: at_system, length: dict(enumerate(linear))}


def _document(rng: random.Random, serial: int) -> Any:
    import torch
    from hypic.cache.composition import Family, Transition
    from hypic.cache.segments import Seams
    from hypic.cache.store import AttentionInterior, LinearInterior, SegmentEntry

    length = rng.randint(300, 1500)
    layers: list[Any] = [LinearInterior(Transition(Family.DENSE, _fresh(32, 128, 128)), _fresh(*STATE), _fresh(*CONV))
                         for _ in range(LINEAR)]
    layers += [AttentionInterior(_fresh(KV_HEADS, length, HEAD_DIM, dtype=torch.bfloat16),
                                 _fresh(KV_HEADS, length, HEAD_DIM, dtype=torch.bfloat16)) for _ in range(ATTENTION)]
    return SegmentEntry(f"doc{serial}", (serial,), Seams(4, 4), 4, length, layers)


def _churn(pool: str, inserts: int, budget: int, seed: int) -> dict:
    """One pool's churn in this process (the child's work)."""
    import torch
    from hypic.cache.prefix_cache import PrefixCache
    from hypic.cache.store import SegmentStore

    torch.set_num_threads(1)
    rng, rss, times, filled = random.Random(seed), [], [], None
    cache = PrefixCache(budget_bytes=budget) if pool == "private" else SegmentStore(budget_bytes=budget)
    for serial in range(inserts):
        if pool == "private":
            state, snapshots = _request(rng, serial)
            start = time.perf_counter()
            cache.insert("m", state, snapshots)
            del state, snapshots
        else:
            entry = _document(rng, serial)
            start = time.perf_counter()
            cache.put(entry)
            del entry
        times.append(time.perf_counter() - start)
        rss.append(_rss())
        if filled is None and cache.evictions > 0:
            filled = len(rss) - 1
    filled = filled if filled is not None else len(rss) - 1
    reserved = getattr(cache, "reserved_bytes", None) if pool == "private" else None
    if pool == "public" and hasattr(cache, "arenas"):
        reserved = cache.arenas.reserved_bytes
    import hypic
    return {"code": hypic.__file__, "pool": pool, "inserts": inserts, "budget_bytes": budget, "evictions": cache.evictions,
            "pool_bytes": cache.nbytes, "arena_reserved_bytes": reserved, "rss_at_fill": rss[filled],
            "rss_peak_after_fill": max(rss[filled:]), "rss_end": rss[-1], "insert_seconds_median": statistics.median(times),
            "rss": rss, "insert_seconds": times}


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev], check=True,
                   capture_output=True)
    return where


def _child(code: Path, pool: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", pool, "--inserts", str(args.inserts),
                          "--budget", str(args.budget)], env=env, cwd=code, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _table(results: dict[str, dict[str, dict]]) -> list[str]:
    mib = lambda b: f"{b / 2**20:,.0f}"  # noqa: E731
    lines = ["| pool | code | RSS at fill (MiB) | peak after (MiB) | end (MiB) | growth after fill | insert median (ms) | arena reserved (MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for pool in ("private", "public"):
        for code in ("before", "arenas"):
            r = results[code][pool]
            growth = (r["rss_peak_after_fill"] - r["rss_at_fill"]) / 2**20
            reserved = mib(r["arena_reserved_bytes"]) if r["arena_reserved_bytes"] is not None else "-"
            lines.append(f"| {pool} | {code} | {mib(r['rss_at_fill'])} | {mib(r['rss_peak_after_fill'])} | {mib(r['rss_end'])} "
                         f"| {growth:+,.0f} MiB | {1000 * r['insert_seconds_median']:.1f} | {reserved} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="3ab1021", help="the revision before the arenas (compared in a worktree)")
    parser.add_argument("--inserts", type=int, default=120)
    parser.add_argument("--budget", type=int, default=1 << 30, help="each pool's budget in bytes (default 1 GiB)")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--child", choices=["private", "public"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_churn(args.child, args.inserts, args.budget, seed=1)))
        return
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        before = _worktree(args.before, Path(scratch) / "before")
        try:
            for code, path in (("before", before), ("arenas", ROOT)):
                results[code] = {pool: _child(path, pool, args) for pool in ("private", "public")}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)
    machine = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
               "before": args.before, "inserts": args.inserts, "budget_bytes": args.budget}
    print("\n".join(_table(results)))
    for pool in ("private", "public"):
        b, a = results["before"][pool], results["arenas"][pool]
        print(f"{pool}: RSS growth after fill {(a['rss_peak_after_fill'] - a['rss_at_fill']) / 2**20:+.0f} MiB with arenas "
              f"vs {(b['rss_peak_after_fill'] - b['rss_at_fill']) / 2**20:+.0f} MiB before; insert time "
              f"{a['insert_seconds_median'] / b['insert_seconds_median']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))


if __name__ == "__main__":
    main()
