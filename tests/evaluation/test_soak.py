"""``hypic eval soak``: a two-minute soak of a real server with a SIGKILL in the middle passes every
check; the report's checks each fail on records that break them (synthetic records, closed-form
counts), so a passing soak means something."""
import argparse
import json
from pathlib import Path

import pytest

from hypic.cli import main
from hypic.evaluation.soak import add_arguments
from hypic.evaluation.soak_report import recoveries, rss_lives, summarize_soak, worker_rss_lives


def _args(**options: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in options.items()])


def test_a_75_s_soak_with_a_server_kill_passes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Mixed load with two namespaces for 75 s, the server SIGKILLed and restarted at 25 and 50 s: no
    wrong answer (replays on a quiet server included), no 5xx, answers again within seconds, RSS
    flat in each server life, pools within budget; a rerun only reports."""
    argv = ["eval", "soak", "--minutes", "1.25", "--fault-every", "25", "--sample-s", "3", "--model", str(tiny_checkpoint),
            "--pool-size", "8M", "--replay-every", "4", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    summary = json.loads((tmp_path / "soak_summary.json").read_text())
    assert summary["passed"], summary["checks"]
    assert [f["kind"] for f in summary["faults"]] == ["kill_server"] * 2
    assert all(f["recovered_after_s"] < 60 for f in summary["faults"])
    assert summary["replays"] >= 10 and summary["replays_same"] == summary["replays"]
    assert set(summary["by_kind"]) >= {"pic", "plain", "chat", "structured", "samples", "dropped", "bad", "warmup",
                                       "flush", "info", "probe_other", "probe_cold"}
    assert summary["checks"]["no_timing_leak"] is True  # enough probes to judge, and no leak
    assert summary["outcomes"]["ok"] > 100 and "5xx" not in summary["outcomes"]
    assert len(summary["rss"]) == 3 and all(life["growth"] is not None for life in summary["rss"][:2])
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    assert sorted(p.name for p in (tmp_path / "soak_logs").iterdir()) == ["reference.log", "server-1.log",
                                                                          "server-2.log", "server-3.log"]
    records = (tmp_path / "soak.jsonl").read_text()
    assert main(argv) == 0 and (tmp_path / "soak.jsonl").read_text() == records  # reported, not run again


def _request(start: float, outcome: str = "ok", **fields: object) -> dict:
    return {"type": "request", "kind": "pic", "status": 200, "start_s": start, "latency_s": 0.5, "ttft_s": 0.2,
            "outcome": outcome, "wrong": "", "during_fault": False, **fields}


def _healthy() -> list[dict]:
    records = [_request(float(t)) for t in range(0, 100, 2)]
    records += [{"type": "sample", "t_s": float(t), "life": 1, "rss_mb": 500.0 + (40 if t < 20 else 0),
                 "pools": {"public_pool": {"bytes": 19, "budget_bytes": 20}}} for t in range(0, 100, 10)]
    records += [{"type": "replay", "kind": "pic", "start_s": 1.0, "status": 200, "same": True, "expected": "a", "got": "a"}]
    return records


@pytest.mark.parametrize(("damage", "check"), [
    (lambda r: r.append(_request(50.0, "5xx", status=500)), "no_5xx"),
    (lambda r: r.append({"type": "replay", "kind": "pic", "start_s": 3.0, "status": 200, "same": False,
                         "expected": "a", "got": "b"}), "no_wrong_answers"),
    (lambda r: r.append(_request(7.0, wrong="a bad body was accepted")), "no_wrong_answers"),
    (lambda r: r.append(_request(30.0, "no_answer", status=None)), "answered_outside_faults"),
    (lambda r: r.append({"type": "fault", "t_s": 99.5, "back_s": 99.6, "kind": "kill_server"}), "faults_recovered"),
    (lambda r: [s.update(rss_mb=500.0 + 2 * s["t_s"]) for s in r if s["type"] == "sample"], "rss_flat"),
    (lambda r: r[-2]["pools"]["public_pool"].update(bytes=21), "pools_within_budget"),
])
def test_each_check_fails_on_records_that_break_it(damage, check: str) -> None:
    args = _args(minutes=100 / 60)
    assert summarize_soak(_healthy(), args)["passed"]
    records = _healthy()
    damage(records)
    summary = summarize_soak(records, args)
    assert not summary["checks"][check] and not summary["passed"]
    assert [name for name, ok in summary["checks"].items() if ok is False] == [check]


def test_rss_growth_and_recovery_in_closed_form() -> None:
    """Growth is judged after each life's warm-up fifth, from its first judged sample to its largest;
    recovery runs from a fault to the end of the first answer after it; a request in flight when the
    server was killed is no failure."""
    samples = [{"type": "sample", "t_s": float(t), "life": 1, "rss_mb": 100.0 + t} for t in range(0, 50, 10)]
    (life,) = rss_lives(samples, 0.2)
    assert (life["rss_after_warmup_mb"], life["rss_max_mb"]) == (110.0, 140.0)
    assert life["growth"] == pytest.approx(140 / 110 - 1)
    for sample in samples:  # the pools fill up at 20 s: judged from there
        sample["pools"] = {"public_pool": {"bytes": 9 if sample["t_s"] >= 20 else 5, "budget_bytes": 10}}
    (life,) = rss_lives(samples, 0.2)
    assert (life["rss_after_warmup_mb"], life["growth"]) == (120.0, pytest.approx(140 / 120 - 1))
    faults = [{"type": "fault", "t_s": 10.0, "back_s": 14.0, "kind": "kill_server"}]
    requests = [_request(9.0, "no_answer", status=None), _request(12.0, "no_answer", status=None), _request(15.0)]
    assert recoveries(faults, requests)[0]["recovered_after_s"] == pytest.approx(5.5)
    summary = summarize_soak([*_healthy(), *faults, *requests], _args(minutes=100 / 60))
    assert summary["unanswered_outside_faults"] == 0 and summary["checks"]["answered_outside_faults"]


def _with_workers(records: list[dict], rss_of: dict[str, object]) -> list[dict]:
    """``records`` whose samples also read each worker pid's RSS (``rss_of[pid](t_s)``)."""
    for sample in (r for r in records if r["type"] == "sample"):
        sample["workers_rss_mb"] = {pid: rss(sample["t_s"]) for pid, rss in rss_of.items()}
    return records


def test_a_growing_ray_worker_fails_its_own_check() -> None:
    """The workers' RSS is judged by the server's rule: a flat worker passes, one growing 2 MB a
    second after warm-up fails ``worker_rss_flat`` alone (the server is flat); without worker
    samples the check is not applicable."""
    args = _args(minutes=100 / 60)
    assert summarize_soak(_healthy(), args)["checks"]["worker_rss_flat"] is None
    flat = summarize_soak(_with_workers(_healthy(), {"41": lambda t: 700.0}), args)
    assert flat["passed"] and flat["checks"]["worker_rss_flat"] is True
    growing = summarize_soak(_with_workers(_healthy(), {"41": lambda t: 700.0, "42": lambda t: 600.0 + 2 * t}), args)
    assert [name for name, ok in growing["checks"].items() if ok is False] == ["worker_rss_flat"]
    worker = next(w for w in growing["worker_rss"] if w["worker_pid"] == 42)
    # judged from 20 s (the warm-up fifth of 0..90 s): 640 MB, at most 780 MB
    assert (worker["rss_after_warmup_mb"], worker["rss_max_mb"]) == (640.0, 780.0)
    assert worker["growth"] == pytest.approx(780 / 640 - 1)
    assert worker["slope_mb_per_min_second_half"] == pytest.approx(120.0)  # 2 MB/s


def test_a_worker_replaced_midway_is_a_new_life() -> None:
    """Samples name workers by pid: one killed at 50 s and its replacement are judged apart."""
    samples = [{"type": "sample", "t_s": float(t), "life": 1, "rss_mb": 500.0,
                "workers_rss_mb": {"7" if t < 50 else "8": 300.0 + t}} for t in range(0, 100, 10)]
    lives = worker_rss_lives(samples, 0.0)
    assert [(w["worker_pid"], w["from_s"], w["to_s"]) for w in lives] == [(7, 0.0, 40.0), (8, 50.0, 90.0)]
    assert [w["rss_after_warmup_mb"] for w in lives] == [300.0, 350.0]


def test_a_timing_leak_across_namespaces_is_caught() -> None:
    """Probes for another namespace's documents answered from its cache (fast) fail the check;
    drawn from the cold probes' own distribution, they pass."""
    import random
    rng = random.Random(4)
    cold = [_request(float(i), kind="probe_cold", ttft_s=rng.uniform(0.8, 1.2)) for i in range(30)]
    same = [_request(float(i), kind="probe_other", ttft_s=rng.uniform(0.8, 1.2)) for i in range(30)]
    leaked = [_request(float(i), kind="probe_other", ttft_s=rng.uniform(0.2, 0.4)) for i in range(30)]
    args = _args(minutes=100 / 60)
    assert summarize_soak([*_healthy(), *cold, *same], args)["checks"]["no_timing_leak"] is True
    summary = summarize_soak([*_healthy(), *cold, *leaked], args)
    assert summary["checks"]["no_timing_leak"] is False and summary["namespace_timing"]["p_value"] < 0.001
