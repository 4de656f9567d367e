"""``hypic eval parallel``: the simulator against hand-computed LPT numbers, and a tiny run on Ray
workers that records each phase, draws the figure and resumes without starting Ray again."""
import json
from pathlib import Path

import pytest

import hypic.router
from hypic.cli import main
from hypic.evaluation.parallel import ENGINE, simulate, summarize_parallel


def test_simulator_predicts_lpt_makespans_from_two_points() -> None:
    rows = [{"workers": 1, "dispatch_s": 10.0, "transfer_s": 0.0, "combine_s": 1.0, "shipped_docs": 0},
            {"workers": 2, "dispatch_s": 6.0, "transfer_s": 0.4, "combine_s": 0.5, "shipped_docs": 2}]
    # 5 documents of 100 tokens: 0.02 s per token built (2 s a document), 0.2 s per shipped document,
    # the combine pass 1 s (0.2 s a document; 50 build tokens of load on the combine node, worker 0)
    predicted = simulate(rows, docs=5, doc_tokens=100, counts=(1, 2, 3, 5, 8))
    assert predicted[1] == pytest.approx(10 + 1)
    # LPT from loads (50, 0): documents 0, 2, 4 to worker 1, arriving at 2.2, 4.2, 6.2; 1, 3 built on 0 by 4.
    # From 4, documents 0-3 are combined (0.2 each, document 2 arrived at 4.2 < 4.4); document 4 at 6.2 + 0.2
    assert predicted[2] == pytest.approx(6.2 + 0.2)
    # (50, 0, 0): 0, 3 to worker 1, 1, 4 to worker 2, 2 on 0 by 2: the first three combined by 2.8,
    # documents 3 and 4 arrive at 4.2
    assert predicted[3] == pytest.approx(4.2 + 2 * 0.2)
    # one document each (the combine node builds the last, or none): all arrive by 2.2, combined one by one
    assert predicted[5] == pytest.approx(2.0 + 6 * 0.2) and predicted[8] == pytest.approx(2.2 + 5 * 0.2)
    assert simulate(rows[:1], 5, 100) == {}


def test_summary_takes_medians_and_speedups_over_the_fewest_workers() -> None:
    records = [{"workers": w, "ttft_s": t, "dispatch_s": t - 1, "transfer_s": 0.0, "combine_s": 1.0, "shipped_docs": 0}
               for w, t in ((1, 9.0), (1, 11.0), (1, 10.0), (2, 6.0), (2, 4.0), (2, 5.0))]
    records.append({"workers": ENGINE, "ttft_s": 9.5})
    rows = {r["workers"]: r for r in summarize_parallel(records)}
    assert rows[1]["ttft_s"] == 10.0 and rows[2]["ttft_s"] == 5.0 and rows[2]["speedup"] == 2.0
    assert rows[ENGINE]["dispatch_s"] is None and "speedup" not in rows[ENGINE]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_parallel_on_ray_records_phases_and_resumes(tiny_checkpoint: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["eval", "parallel", "--model", str(tiny_checkpoint), "--docs", "3", "--doc-tokens", "48",
            "--workers", "1", "2", "--repeats", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    records = {r["workers"]: r for r in _lines(tmp_path / "parallel.jsonl")}
    assert set(records) == {ENGINE, 1, 2}
    for workers in (1, 2):
        r = records[workers]
        assert 0 < r["dispatch_s"] and 0 <= r["transfer_s"] and 0 < r["combine_s"]
        assert r["dispatch_s"] + r["transfer_s"] + r["combine_s"] <= r["ttft_s"] * 1.05
    # LPT counts the combine pass on the combine node: the peer builds more of the 3 documents
    assert records[1]["shipped_docs"] == 0 and records[2]["shipped_docs"] >= 2
    summary = json.loads((tmp_path / "parallel_summary.json").read_text())
    assert set(summary["simulated_ttft_s"]) == {"1", "2", "4", "8", "16", "32"}
    assert (tmp_path / "parallel.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a finished point ran again")

    monkeypatch.setattr(hypic.router, "Router", refuse)
    monkeypatch.setattr("hypic.evaluation.parallel.Engine.from_pretrained", refuse)
    assert main(args) == 0
    assert len(_lines(tmp_path / "parallel.jsonl")) == 3


def test_bad_parallel_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "parallel", "--workers", "0", "--out", str(tmp_path)]) == 2
    assert "--workers must be >= 1" in capsys.readouterr().err
    assert main(["eval", "parallel", "--model", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
