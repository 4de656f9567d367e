"""``hypic eval`` end to end on the shipped model: each study writes its JSONL, summary and PNG,
a rerun redoes nothing, and bad input is a clear error that keeps finished samples."""
import json
import re
from pathlib import Path

import pytest

import hypic.evaluation.drift as drift
import hypic.evaluation.scaling as scaling
import hypic.evaluation.targets as targets
from hypic.cli import main
from hypic_data.synthetic_qa import GeneratorConfig, generate_example

FIXTURES = Path(__file__).resolve().parents[2] / "datasets" / "longbench_fixtures"


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "test.jsonl"
    examples = [generate_example(GeneratorConfig(min_docs=4, max_docs=5), "test", i) for i in range(2)]
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pareto_writes_records_summary_and_figure_then_resumes(synthetic: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["eval", "pareto", "--data", str(synthetic), "--limit", "2", "--methods", "hypic:4", "naive",
            "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    records = _lines(tmp_path / "pareto.jsonl")
    assert [(r["sample"], r["method"]) for r in records] == [
        (s, m) for s in ("test-000000", "test-000001") for m in ("full", "hypic:4", "naive")]
    documents = {e["id"]: len(e["documents"]) for e in _lines(synthetic)}
    for r in records:
        assert r["score"] in (0.0, 1.0) and r["ttft_s"] > 0 and r["warm"]
        if r["method"] != "full":  # warmed first: every document a hit
            assert r["segments_hit"] == documents[r["sample"]] and r["cached_tokens"] > 0
        else:
            assert r["cached_tokens"] == 0 and r["agrees_with_full"]
    summary = json.loads((tmp_path / "pareto_summary.json").read_text())
    assert {row["method"] for row in summary["rows"]} == {"full", "hypic:4", "naive"}
    assert (tmp_path / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def refuse(*_: object) -> None:
        raise AssertionError("a finished sample ran again")

    monkeypatch.setattr(targets, "run_sample", refuse)
    assert main(args) == 0  # everything is in the JSONL: nothing runs
    assert _lines(tmp_path / "pareto.jsonl") == records


def test_a_cut_last_line_reruns_only_that_sample(synthetic: Path, tmp_path: Path) -> None:
    args = ["eval", "seam", "--data", str(synthetic), "--limit", "1", "--widths", "0", "8", "--out", str(tmp_path),
            "--no-progress"]
    assert main(args) == 0
    lines = (tmp_path / "seam.jsonl").read_text().splitlines()
    assert [json.loads(line)["method"] for line in lines] == ["full", "hypic:0", "hypic:8"]
    (tmp_path / "seam.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2] + "\n")
    assert main(args) == 0
    again = _lines_tolerant(tmp_path / "seam.jsonl")
    assert [r["method"] for r in again] == ["full", "hypic:0", "hypic:8"]  # the cut line was redone, once
    assert again[:2] == [json.loads(line) for line in lines[:2]]
    assert (tmp_path / "seam.png").is_file()


def _lines_tolerant(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def test_longbench_fixture_scores_with_f1(tmp_path: Path) -> None:
    args = ["eval", "pareto", "--dataset", "hotpotqa", "--data", str(FIXTURES / "hotpotqa.jsonl"), "--methods",
            "hypic", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    records = _lines(tmp_path / "pareto.jsonl")
    assert len(records) == 4 and {r["metric"] for r in records} == {"f1"}
    assert all(0.0 <= r["score"] <= 1.0 for r in records)
    # the fixture marks 3 and 2 passages: each a document, each cached before hypic's request
    assert [r["segments_hit"] for r in records if r["method"] == "hypic:8"] == [3, 2]
    assert [r["cached_tokens"] for r in records if r["method"] == "full"] == [0, 0]


@pytest.mark.parametrize("extra, message", [
    (["--methods", "hypic:x"], "seam width must be an integer"),
    (["--methods", "magic"], "unknown method 'magic'"),
    (["--data", "/nonexistent/test.jsonl"], "does not exist"),
    (["--dataset", "hotpotqa"], "--data is required"),
    (["--model", "/nonexistent/model"], "is not a directory"),
])
def test_bad_input_is_a_clear_error(synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    extra: list[str], message: str) -> None:
    data = [] if "--data" in extra or "--dataset" in extra else ["--data", str(synthetic)]
    assert main(["eval", "pareto", *data, "--out", str(tmp_path), "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err


def test_url_mode_gives_the_in_process_numbers(synthetic: Path, tmp_path: Path) -> None:
    """The same samples against a real ``hypic serve`` (mode hypic, w = 8) and in process: the same
    predictions, scores and reuse; a method the server does not serve, and a dead URL, are clear errors."""
    from hypic.server.launch import start_server

    server = start_server(["--seam-width", "8", "--log-level", "warning"], tmp_path / "server.log")
    try:
        common = ["eval", "pareto", "--data", str(synthetic), "--limit", "2", "--no-progress"]
        assert main([*common, "--methods", "hypic:8", "--url", server.url, "--out", str(tmp_path / "url")]) == 0
        assert main([*common, "--methods", "hypic:8", "--out", str(tmp_path / "local")]) == 0
        assert main([*common, "--methods", "naive", "--url", server.url, "--out", str(tmp_path / "bad")]) == 2
    finally:
        server.stop()
    remote = _lines(tmp_path / "url" / "pareto.jsonl")
    local = [r for r in _lines(tmp_path / "local" / "pareto.jsonl") if r["method"] == "hypic:8"]
    assert len(remote) == len(local) == 2
    for a, b in zip(remote, local):
        for key in ("sample", "prediction", "output_ids", "score", "cached_tokens", "recomputed_tokens", "segments_hit"):
            assert a[key] == b[key], key
        assert a["agrees_with_full"] is None  # the server runs hypic only: no full reference there
    assert main([*common, "--url", server.url, "--out", str(tmp_path / "dead")]) == 2


def test_drift_is_zero_for_full_exact_at_hypics_first_layer_and_large_for_naive(
        synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["eval", "drift", "--data", str(synthetic), "--limit", "1", "--methods", "full", "naive", "hypic:8",
            "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    records = {r["method"]: r for r in _lines(tmp_path / "drift.jsonl")}
    assert records["full"]["rel_l2"] == [0.0] * len(records["full"]["layers"])
    assert records["hypic:8"]["rel_l2"][0] < 1e-5  # below the first attention layer composition is exact
    assert records["naive"]["rel_l2"][0] > 1e-3 and records["naive"]["angle_deg"][0] > 0.01
    assert (tmp_path / "drift.png").is_file() and "layer 0" in capsys.readouterr().out
    assert main([*args, "--url", "http://127.0.0.1:9"]) == 2

    def refuse(*_: object) -> None:
        raise AssertionError("a finished sample ran again")

    monkeypatch.setattr(drift, "final_states", refuse)
    assert main(args) == 0 and {r["method"]: r for r in _lines(tmp_path / "drift.jsonl")} == records


def test_scaling_study_runs_the_fig12_sweeps(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``hypic eval scaling`` hands its options to the sweeps (a tiny random model here): the shapes and
    the model it measured are the ones asked for, and hypic recomputed only L, the seams and Q; each
    shape is a JSONL record, a rerun measures nothing, another model measures again."""
    out = tmp_path / "scaling.json"
    args = ["eval", "scaling", "--hidden-size", "64", "--layers", "4", "--repeats", "1", "--no-progress",
            "--doc-lengths", "64", "--doc-counts", "2", "3", "--fixed-count", "2", "--fixed-length", "64",
            "--json", str(out), "--out", str(tmp_path)]
    assert main(args) == 0
    written = json.loads(out.read_text())
    assert [(s["num_docs"], s["doc_tokens"]) for s in written["shapes"]] == [(2, 64), (3, 64)]
    assert written["environment"]["hidden_size"] == 64 and written["environment"]["layers"] == 4
    assert all(s["hypic_recomputed_tokens"] == 32 + s["num_docs"] * 16 + 32 for s in written["shapes"])
    assert "speedup" in capsys.readouterr().out
    records = _lines(tmp_path / "scaling.jsonl")
    assert [r["sample"] for r in records] == ["2x64", "3x64"]
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "scaling_summary.json").read_text())["shapes"] == written["shapes"]

    def refuse(*_: object) -> None:
        raise AssertionError("a recorded shape was measured again")

    monkeypatch.setattr(scaling, "measure_shape", refuse)
    assert main(args) == 0 and _lines(tmp_path / "scaling.jsonl") == records
    with pytest.raises(AssertionError, match="measured again"):  # a different model is not the recorded one
        main([*args[:3], "96", *args[4:]])
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "scaling", "--repeats", "0"])
    assert exit_info.value.code == 2 and "--repeats must be >= 1" in capsys.readouterr().err


def test_unknown_options_are_refused_outside_scaling(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "pareto", "--bogus"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_two_ranks_give_one_ranks_records(synthetic: Path, tmp_path: Path) -> None:
    """``--tp-size 2`` runs the study on two ranks of the shipped model (float32, so no rounding
    tie can flip): the same predictions, tokens and reuse as one rank; a rerun resumes on both."""
    common = ["eval", "pareto", "--data", str(synthetic), "--limit", "2", "--methods", "hypic:8",
              "--dtype", "float32", "--no-progress"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    two = tmp_path / "two"
    assert main([*common, "--limit", "1", "--tp-size", "2", "--out", str(two)]) == 0
    assert main([*common, "--tp-size", "2", "--out", str(two)]) == 0  # resumes: sample 1 only
    assert json.loads((two / "pareto_summary.json").read_text())["tp_size"] == 2  # the engine that ran: 2 shards
    one_rank, two_ranks = _lines(tmp_path / "one" / "pareto.jsonl"), _lines(two / "pareto.jsonl")
    assert [(r["sample"], r["method"]) for r in two_ranks] == [(r["sample"], r["method"]) for r in one_rank]
    for a, b in zip(one_rank, two_ranks):
        for key in ("prediction", "output_ids", "score", "cached_tokens", "recomputed_tokens", "segments_hit",
                    "agrees_with_full"):
            assert a[key] == b[key], key


def test_a_rank_that_dies_mid_study_is_a_clear_error_naming_it(synthetic: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 of ``--tp-size 2`` exits at its first request: the run ends with status 2 within 30 s,
    naming the rank, and this process (rank 0) goes on."""
    import os
    import time
    helpers = Path(__file__).resolve().parents[1] / "helpers"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(helpers / "faults"), str(helpers.parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYPIC_TEST_FAULT", "follower_generate_exit")
    start = time.monotonic()
    assert main(["eval", "pareto", "--data", str(synthetic), "--limit", "1", "--methods", "hypic:8", "--tp-size", "2",
                 "--out", str(tmp_path), "--no-progress"]) == 2
    assert time.monotonic() - start < 30
    assert re.search(r"tensor-parallel rank 1 \(pid \d+\) died \(exit code 7\)", capsys.readouterr().err)


@pytest.mark.parametrize("extra, message", [
    (["--tp-size", "3"], "not divisible by the tensor-parallel size 3"),
    (["--tp-size", "2", "--url", "http://127.0.0.1:9"], "hypic serve --tp-size"),
])
def test_a_tp_size_that_cannot_run_is_a_clear_error(synthetic: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str], extra: list[str],
                                                    message: str) -> None:
    assert main(["eval", "pareto", "--data", str(synthetic), "--limit", "1", "--out", str(tmp_path),
                 "--no-progress", *extra]) == 2
    assert message in capsys.readouterr().err
