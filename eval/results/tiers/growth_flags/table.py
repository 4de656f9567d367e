"""The before/after table of run.sh's capacity runs: per side, configuration and size, the document
hit rate / p50 TTFT / p90 TTFT (s) over every timed request of every round, and the public pool's
mean entries and MiB (sampled after each timed request).

    python eval/results/tiers/growth_flags/table.py [FOLDER]
"""
import json
import statistics
import sys
from pathlib import Path
from typing import Any

SIDES = ("before", "after")


def records(folder: Path) -> list[dict[str, Any]]:
    """Every capacity record under FOLDER/{before,after}/*/tiers.jsonl, with its side and round."""
    found = []
    for side in SIDES:
        for path in sorted((folder / side).glob("*/tiers.jsonl")):
            round_name = path.parent.name.split("-")[0]
            found += [{**json.loads(line), "side": side, "round": round_name} for line in path.open()]
    return found


def cell(group: list[dict[str, Any]]) -> dict[str, float]:
    hits = sum(r["segments_hit"] for r in group)
    ttft = sorted(r["ttft_s"] for r in group)
    return {"hit": hits / max(1, hits + sum(r["segments_missed"] for r in group)),
            "p50": ttft[len(ttft) // 2], "p90": ttft[int(0.9 * (len(ttft) - 1))], "n": len(group),
            "entries": statistics.mean(r["pool_entries"] for r in group),
            "mib": statistics.mean(r["pool_bytes"] for r in group) / 2**20,
            "recomputed": statistics.mean(r["prompt_tokens"] - sum(r["by_tier"].values()) for r in group),
            "rounds": len({r["round"] for r in group})}


def table(found: list[dict[str, Any]]) -> str:
    sizes = sorted({r["fraction"] for r in found})
    lines = ["| config | side | " + " | ".join(f"{s:g}x" for s in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    pools = ["| config | side | " + " | ".join(f"{s:g}x" for s in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    work = list(pools)
    run_everywhere = [c for c in dict.fromkeys(r["config"] for r in found)  # a config one side ran alone is left out
                      if {(r["side"], r["fraction"]) for r in found if r["config"] == c} == {(side, s) for side in SIDES for s in sizes}]
    for config in run_everywhere:
        for side in SIDES:
            cells = [cell([r for r in found if (r["config"], r["side"], r["fraction"]) == (config, side, s)])
                     for s in sizes]
            lines.append(f"| {config} | {side} | " + " | ".join(
                f"{c['hit']:.2f} / {c['p50']:.2f} / {c['p90']:.2f}" for c in cells) + " |")
            pools.append(f"| {config} | {side} | " + " | ".join(
                f"{c['entries']:.1f} / {c['mib']:.1f}" for c in cells) + " |")
            work.append(f"| {config} | {side} | " + " | ".join(f"{c['recomputed']:.0f}" for c in cells) + " |")
    counts = {(r["side"], r["config"], r["fraction"]): 0 for r in found}
    for r in found:
        counts[(r["side"], r["config"], r["fraction"])] += 1
    return ("hit rate / p50 TTFT (s) / p90 TTFT (s):\n\n" + "\n".join(lines)
            + "\n\npublic pool: mean entries / mean MiB held:\n\n" + "\n".join(pools)
            + "\n\nprompt tokens recomputed per request (mean; the rest loaded from a tier):\n\n" + "\n".join(work)
            + f"\n\ntimed requests per cell: {sorted(set(counts.values()))}")


def per_round(found: list[dict[str, Any]]) -> str:
    """p50 TTFT (s) of each round, to show the spread between rounds."""
    lines = []
    for key in sorted({(r["config"], r["fraction"], r["side"]) for r in found}):
        p50s = [cell([r for r in found if (r["config"], r["fraction"], r["side"]) == key and r["round"] == n])["p50"]
                for n in sorted({r["round"] for r in found if (r["config"], r["fraction"], r["side"]) == key})]
        lines.append(f"{key[0]:>11} {key[1]:>4g}x {key[2]:>6}: " + " ".join(f"{p:.3f}" for p in p50s))
    return "\n".join(lines)


if __name__ == "__main__":
    found = records(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
    print(table(found))
    print("\np50 TTFT per round:\n" + per_round(found))
