"""``hypic eval tiers`` end to end on the tiny model (disk only, small sizes): every part runs through
the CLI and reports what the engine did, checked against what must hold whatever the timings: a
restart on the disk hits every warmed document and one without it none; a disk tier never lowers
the hit rate; memory is the fastest tier to load from."""
import json
import statistics
from pathlib import Path

import pytest

from hypic.cli import main


def test_the_tiers_study_runs_and_reports(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    status = main(["eval", "tiers", "--model", str(tiny_checkpoint), "--shapes", "model", "--repeats", "2",
                   "--doc-tokens", "200", "--request-words", "200", "--restart-docs", "3", "--memory-docs", "8", "--fractions", "0.5", "4",
                   "--requests", "12", "--warm-requests", "12", "--out", str(out)])
    assert status in (0, None)
    summary = json.loads((out / "tiers_summary.json").read_text())
    records = [json.loads(line) for line in (out / "tiers.jsonl").read_text().splitlines()]
    assert summary["restart"]["with disk"]["segments_hit"] == 3 and summary["restart"]["without disk"]["segments_hit"] == 0
    latency = {r["tier"]: r["median_s"] for r in records if r["part"] == "latency"}
    assert set(latency) == {"memory", "disk (page cache)", "disk (dropped)", "rebuild"}
    assert latency["memory"] < latency["disk (page cache)"]
    for record in (r for r in records if r["part"] == "latency" and r["tier"] != "memory"):  # the rate, from the raw timings
        row = summary["latency"][f"{record['model']} | {record['tier']}"]
        assert row["gb_per_s"] == pytest.approx(record["entry_bytes"] / statistics.median(record["seconds"]) / 1e9)
    capacity = summary["capacity"]
    for eviction in ("lru", "cost"):
        assert capacity[f"+disk/{eviction} @ 4x"]["hit_rate"] >= capacity[f"memory/{eviction} @ 4x"]["hit_rate"]
        assert capacity[f"memory/{eviction} @ 0.5x"]["hit_rate"] == 1.0  # everything fits: no miss once warm
    assert sum(r["by_tier"]["disk"] > 0 for r in records if r["part"] == "capacity" and r["config"].startswith("+disk"))
    assert (out / "tiers.png").stat().st_size > 0


def test_the_conversation_part_resumes_each_turn_on_another_server_through_mooncake(tiny_checkpoint: Path,
                                                                                    tmp_path: Path) -> None:
    """Every turn after the first resumes where the previous turn ended (its prompt and all but its
    last output token, closed form) from Mooncake when memory was emptied, from memory on the same
    server, and nowhere without the resume points."""
    out, turn_tokens = tmp_path / "out", 4
    status = main(["eval", "tiers", "--model", str(tiny_checkpoint), "--parts", "conversation", "--mooncake",
                   "--repeats", "1", "--turns", "3", "--turn-words", "20", "--turn-tokens", str(turn_tokens),
                   "--out", str(out)])
    assert status in (0, None)
    records = [json.loads(line) for line in (out / "tiers.jsonl").read_text().splitlines()]
    by_way: dict[str, list[dict]] = {}
    for record in records:
        by_way.setdefault(record["way"], []).append(record)
    for way, tier in (("another server, resume points in Mooncake", "mooncake"), ("same server", "device")):
        turns = by_way[way]
        assert len(turns) == 4 and turns[0]["prefix_hit_tokens"] == 0
        for before, turn in zip(turns, turns[1:]):
            assert turn["prefix_hit_tokens"] == turn["by_tier"][tier] == before["prompt_tokens"] + turn_tokens - 1
    assert all(r["prefix_hit_tokens"] == 0 for r in by_way["another server, memory only"])
    summary = json.loads((out / "tiers_summary.json").read_text())["conversation"]
    assert summary["another server, memory only"]["resumed_fraction"] == 0 < summary["same server"]["resumed_fraction"]

def test_the_capacity_part_runs_the_chosen_configurations_on_the_pool_bytes_given(tiny_checkpoint: Path,
                                                                                   tmp_path: Path) -> None:
    """``--configs`` picks the configurations run; ``--pool-bytes`` is the public pool's budget: with
    one byte no entry fits, so a document set that fits the default budget (0.5x) gets no hit."""
    def capacity(out: Path, *options: str) -> list[dict]:
        main(["eval", "tiers", "--model", str(tiny_checkpoint), "--parts", "capacity", "--request-words", "200",
              "--fractions", "0.5", "--requests", "4", "--warm-requests", "4", "--configs", "memory/lru",
              *options, "--out", str(out)])
        return [json.loads(line) for line in (out / "tiers.jsonl").read_text().splitlines()]

    sized = capacity(tmp_path / "sized")
    tiny = capacity(tmp_path / "tiny", "--pool-bytes", "1")
    assert {r["config"] for r in sized + tiny} == {"memory/lru"}
    assert all(r["segments_hit"] == 4 and r["pool_entries"] >= 4 for r in sized)  # everything fits once warm
    assert all(r["budget_bytes"] == 1 and r["segments_hit"] == 0 and r["pool_entries"] == 0 for r in tiny)
