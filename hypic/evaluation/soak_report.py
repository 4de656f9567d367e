"""The soak study's report: what its records say, as a summary with pass/fail checks, a table and
a figure (RSS, TTFT and outcomes over time, faults marked)."""
import argparse
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .studies import plain_log_ticks, pyplot, save_figure

TIMED = ("pic", "plain", "chat", "structured")  # kinds whose first token is a model's answer
OUTCOMES = ("ok", "dropped", "4xx", "5xx", "no_answer")
FULL = 0.9  # a pool this close to its budget has filled up
LEAK_P = 0.001  # below this, probes for another namespace's documents are told apart from cold ones


def _of(records: Sequence[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["type"] == kind]


def _first_token_s(request: dict[str, Any]) -> float:
    return request["ttft_s"] if request["ttft_s"] is not None else request["latency_s"]


def windows(requests: Sequence[dict[str, Any]], width_s: float) -> list[dict[str, Any]]:
    """Per ``width_s`` window of start times: outcome counts and the first-token time p50 / p99 of
    the answered model requests."""
    if not requests:
        return []
    rows = []
    for index in range(int(max(r["start_s"] for r in requests) // width_s) + 1):
        inside = [r for r in requests if index * width_s <= r["start_s"] < (index + 1) * width_s]
        timed = [_first_token_s(r) for r in inside if r["kind"] in TIMED and r["outcome"] == "ok"]
        rows.append({"t_s": index * width_s, **Counter(r["outcome"] for r in inside),
                     "ttft_p50_s": float(np.percentile(timed, 50)) if timed else None,
                     "ttft_p99_s": float(np.percentile(timed, 99)) if timed else None})
    return rows


def _pools_full(sample: dict[str, Any]) -> bool:
    pools = sample.get("pools") or {}
    return all(p["budget_bytes"] is None or p["bytes"] >= FULL * p["budget_bytes"] for p in pools.values())


def rss_lives(samples: Sequence[dict[str, Any]], warmup_fraction: float) -> list[dict[str, Any]]:
    """Per server life: RSS after its warm-up (the first ``warmup_fraction`` of the life, and until
    its pools first reach ``FULL`` of their budgets: caches filling up are no leak), its largest
    value after, the growth between them (None: too few samples to judge), and the least-squares
    slope over the life's second half (MB per minute; None under 3 samples)."""
    lives = []
    for life in sorted({s["life"] for s in samples}):
        mine = [s for s in samples if s["life"] == life and s["rss_mb"] is not None]
        if mine:
            lives.append({"life": life, **_rss_life(mine, warmup_fraction)})
    return lives


def _rss_life(mine: Sequence[dict[str, Any]], warmup_fraction: float) -> dict[str, Any]:
    begin, end = mine[0]["t_s"], mine[-1]["t_s"]
    filled = next((s["t_s"] for s in mine if _pools_full(s)), begin)
    judged = [s for s in mine if s["t_s"] >= max(begin + warmup_fraction * (end - begin), filled)]
    growth = max(s["rss_mb"] for s in judged) / judged[0]["rss_mb"] - 1 if len(judged) >= 3 else None
    return {"from_s": begin, "to_s": end, "rss_after_warmup_mb": judged[0]["rss_mb"],
            "rss_end_mb": mine[-1]["rss_mb"], "rss_max_mb": max(s["rss_mb"] for s in judged), "growth": growth,
            "slope_mb_per_min_second_half": _slope([s for s in mine if s["t_s"] >= (begin + end) / 2])}


def _slope(samples: Sequence[dict[str, Any]]) -> float | None:
    """Least-squares slope of RSS over time, MB per minute."""
    if len(samples) < 3:
        return None
    minutes, mb = np.array([s["t_s"] / 60 for s in samples]), np.array([s["rss_mb"] for s in samples])
    return float(np.polyfit(minutes, mb, 1)[0])


def worker_rss_lives(samples: Sequence[dict[str, Any]], warmup_fraction: float) -> list[dict[str, Any]]:
    """``rss_lives`` for each Ray worker actor of the server (a worker's life is its pid's: one
    killed and replaced is a new life), judged by the same rule."""
    pids = sorted({pid for s in samples for pid in s.get("workers_rss_mb") or {}}, key=int)
    lives = []
    for pid in pids:
        mine = [{**s, "rss_mb": s["workers_rss_mb"][pid]} for s in samples if pid in (s.get("workers_rss_mb") or {})]
        lives.append({"worker_pid": int(pid), **_rss_life(mine, warmup_fraction)})
    return lives


def recoveries(faults: Sequence[dict[str, Any]], requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault: the seconds from its injection to the end of the first request answered after it."""
    found = []
    for fault in faults:
        after = [r["start_s"] + r["latency_s"] for r in requests
                 if r["start_s"] >= fault["t_s"] and r["outcome"] in ("ok", "4xx")]
        found.append({**fault, "recovered_after_s": min(after) - fault["t_s"] if after else None})
    return found


def pool_peaks(samples: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    peaks: dict[str, dict[str, Any]] = {}
    for sample in samples:
        for name, pool in (sample.get("pools") or {}).items():
            peak = peaks.setdefault(name, {"max_bytes": 0, "budget_bytes": pool["budget_bytes"]})
            peak["max_bytes"] = max(peak["max_bytes"], pool["bytes"])
    return peaks


def timing_leak(requests: Sequence[dict[str, Any]], rounds: int = 4000, seed: int = 0) -> dict[str, Any]:
    """First-token times of probes for another namespace's documents against probes for documents
    nobody cached: their medians and a two-sided permutation test of the difference of medians
    (a leak makes the first much faster: a tiny p)."""
    times = {kind: np.array([_first_token_s(r) for r in requests if r["kind"] == kind and r["outcome"] == "ok"])
             for kind in ("probe_other", "probe_cold")}
    other, cold = times["probe_other"], times["probe_cold"]
    if min(len(other), len(cold)) < 5:
        return {"probes": [len(other), len(cold)], "p_value": None}
    observed = abs(np.median(other) - np.median(cold))
    pooled, rng = np.concatenate([other, cold]), np.random.default_rng(seed)
    as_extreme = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        as_extreme += abs(np.median(pooled[: len(other)]) - np.median(pooled[len(other):])) >= observed
    return {"probes": [len(other), len(cold)], "other_namespace_p50_s": float(np.median(other)),
            "cold_p50_s": float(np.median(cold)), "p_value": (as_extreme + 1) / (rounds + 1)}


def summarize_soak(records: Sequence[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Counts, checks and their verdict."""
    requests, samples, faults, replays = (_of(records, k) for k in ("request", "sample", "fault", "replay"))
    by_kind: dict[str, Counter] = {}
    for r in requests:
        by_kind.setdefault(r["kind"], Counter())[r["outcome"]] += 1
    wrong = [{"kind": r["kind"], "start_s": r["start_s"], "why": r["wrong"]} for r in requests if r["wrong"]]
    wrong += [{"kind": r["kind"], "start_s": r["start_s"], "why": f"replay gave {r['got']!r}, not {r['expected']!r}"}
              for r in replays if not r["same"]]
    lives, peaks, recovered = rss_lives(samples, args.warmup_fraction), pool_peaks(samples), recoveries(faults, requests)
    judged = [life["growth"] for life in lives if life["growth"] is not None]
    workers = worker_rss_lives(samples, args.warmup_fraction)
    workers_judged = [life["growth"] for life in workers if life["growth"] is not None]
    unanswered = [r for r in requests if r["outcome"] == "no_answer" and not _near_fault(r, faults)]
    leak = timing_leak(requests)
    checks = {
        "no_wrong_answers": not wrong,
        "no_5xx": not any(r["outcome"] == "5xx" for r in requests),
        "answered_outside_faults": not unanswered,
        "faults_recovered": all(f["recovered_after_s"] is not None for f in recovered),
        "rss_flat": bool(judged) and max(judged) <= args.max_rss_growth if args.url is None else None,
        "worker_rss_flat": max(workers_judged) <= args.max_rss_growth if workers_judged else None,
        "pools_within_budget": all(p["budget_bytes"] is None or p["max_bytes"] <= p["budget_bytes"]
                                   for p in peaks.values()),
        "replayed": bool(replays) and all(r["status"] == 200 for r in replays),
        "no_timing_leak": None if leak["p_value"] is None else bool(leak["p_value"] >= LEAK_P),
    }
    width = max(10.0, round(args.minutes * 60 / 20))
    return {"study": "soak", "minutes": args.minutes, "clients": args.clients, "workers": args.workers,
            "dp_size": getattr(args, "dp_size", 1),
            "pool_size": args.pool_size, "cache_dir": None if getattr(args, "cache_dir", None) is None else str(args.cache_dir),
            "disk_cached_tokens": sum(r.get("disk_tokens", 0) for r in requests), "requests": len(requests),
            "outcomes": dict(Counter(r["outcome"] for r in requests)),
            "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())}, "wrong": wrong,
            "replays": len(replays), "replays_same": sum(r["same"] for r in replays),
            "unanswered_outside_faults": len(unanswered), "namespace_timing": leak, "faults": recovered, "rss": lives,
            "worker_rss": workers, "pools": peaks,
            "windows": windows(requests, width), "checks": checks,
            "passed": all(v for v in checks.values() if v is not None)}


def _near_fault(request: dict[str, Any], faults: Sequence[dict[str, Any]]) -> bool:
    """Sent while a fault was being injected, or in flight when it struck (a killed server's answers are lost)."""
    end = request["start_s"] + request["latency_s"]
    return request["during_fault"] or any(f["t_s"] - 1 <= end and request["start_s"] <= f["back_s"] for f in faults)


def format_soak(summary: dict[str, Any]) -> str:
    """The summary as Markdown: outcomes by kind, faults, RSS per server life, the checks."""
    replicas = f"{summary['dp_size']} replicas, " if summary.get("dp_size", 1) > 1 else ""
    lines = [f"soak: {summary['minutes']:g} min, {summary['clients']} clients, {summary['workers']} worker(s), {replicas}pools "
             f"{summary['pool_size']}: {summary['requests']} requests, {summary['replays_same']}/{summary['replays']} "
             f"replays unchanged, {len(summary['wrong'])} wrong", "",
             "| kind | " + " | ".join(OUTCOMES) + " |", "|---|" + "---|" * len(OUTCOMES)]
    for kind, counts in summary["by_kind"].items():
        lines.append(f"| {kind} | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
    lines.append("")
    for fault in summary["faults"]:
        back = fault["recovered_after_s"]
        lines.append(f"- fault {fault['kind']} at {fault['t_s']:.0f} s: "
                     + ("not recovered" if back is None else f"answered again after {back:.1f} s"))
    for life in summary["rss"]:
        growth = "too short to judge" if life["growth"] is None else f"{life['growth']:+.1%}"
        lines.append(f"- server life {life['life']} ({life['from_s']:.0f}-{life['to_s']:.0f} s): RSS after warm-up "
                     f"{life['rss_after_warmup_mb']:.0f} MB, max {life['rss_max_mb']:.0f} MB, growth {growth}"
                     f"{_slope_text(life)}")
    for life in summary.get("worker_rss", []):
        growth = "too short to judge" if life["growth"] is None else f"{life['growth']:+.1%}"
        lines.append(f"- Ray worker {life['worker_pid']} ({life['from_s']:.0f}-{life['to_s']:.0f} s): RSS after "
                     f"warm-up {life['rss_after_warmup_mb']:.0f} MB, max {life['rss_max_mb']:.0f} MB, growth {growth}"
                     f"{_slope_text(life)}")
    leak = summary["namespace_timing"]
    if leak["p_value"] is not None:
        lines.append(f"- another namespace's documents: first token p50 {leak['other_namespace_p50_s']:.3f} s against "
                     f"{leak['cold_p50_s']:.3f} s for documents nobody cached ({leak['probes'][0]} / "
                     f"{leak['probes'][1]} probes; permutation test p = {leak['p_value']:.3f})")
    for name, peak in summary["pools"].items():
        lines.append(f"- {name}: at most {peak['max_bytes'] / 2**20:.1f} MiB of {_mib(peak['budget_bytes'])}")
    lines += [f"- check {name}: {'n/a' if ok is None else 'PASS' if ok else 'FAIL'}" for name, ok in summary["checks"].items()]
    lines += [f"  wrong: {w['kind']} at {w['start_s']:.0f} s: {w['why']}" for w in summary["wrong"][:10]]
    return "\n".join(lines)


def _slope_text(life: dict[str, Any]) -> str:
    slope = life.get("slope_mb_per_min_second_half")
    return "" if slope is None else f", second half {slope:+.2f} MB/min"


def _mib(budget: int | None) -> str:
    return "no budget" if budget is None else f"{budget / 2**20:.1f} MiB"


def draw_soak(records: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], path: Path) -> None:
    """RSS (faults dashed), first-token time p50 / p99 and outcomes per window (``rows``: the
    summary's ``windows``), over time."""
    samples, faults = _of(records, "sample"), _of(records, "fault")
    plt = pyplot()
    figure, (rss, ttft, counts) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    for life in sorted({s["life"] for s in samples}):
        mine = [s for s in samples if s["life"] == life and s["rss_mb"] is not None]
        rss.plot([s["t_s"] / 60 for s in mine], [s["rss_mb"] for s in mine], marker=".", label=f"server life {life}")
    for pid in sorted({pid for s in samples for pid in s.get("workers_rss_mb") or {}}, key=int):
        mine = [s for s in samples if pid in (s.get("workers_rss_mb") or {})]
        rss.plot([s["t_s"] / 60 for s in mine], [s["workers_rss_mb"][pid] for s in mine], marker=".", linestyle=":",
                 label=f"Ray worker {pid}")
    minutes = [row["t_s"] / 60 for row in rows]
    for key, label in (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
        ttft.plot(minutes, [row[key] if row[key] is not None else np.nan for row in rows], marker="o", label=label)
    bottom = np.zeros(len(rows))
    for outcome in OUTCOMES:
        values = np.array([row.get(outcome, 0) for row in rows], dtype=float)
        counts.bar(minutes, values, width=0.8 * (minutes[1] - minutes[0] if len(minutes) > 1 else 1), bottom=bottom,
                   label=outcome, align="edge")
        bottom += values
    for axis in (rss, ttft, counts):
        for fault in faults:
            axis.axvline(fault["t_s"] / 60, linestyle="--", color="gray", linewidth=0.8)
    rss.set(ylabel="RSS (MB)")
    ttft.set(ylabel="first token (s)", yscale="log")
    plain_log_ticks(ttft.yaxis)
    counts.set(ylabel="requests per window", xlabel="minutes (dashed: faults)")
    for axis in (rss, ttft, counts):
        axis.legend(fontsize=7, loc="upper left")
    save_figure(figure, path)
