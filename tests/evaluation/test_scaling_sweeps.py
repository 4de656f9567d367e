"""Smoke test of the Fig. 12 sweeps (``hypic.evaluation.scaling``, ``hypic eval scaling``): a tiny
model, 2-3 documents x 64 tokens, a few seconds."""
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

import hypic.evaluation.scaling as scaling


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return scaling


TINY_ARGS = ["--hidden-size", "64", "--layers", "4", "--repeats", "1", "--no-progress",
             "--doc-lengths", "64", "--doc-counts", "2", "3", "--fixed-count", "2", "--fixed-length", "64"]


def test_tiny_run_structure(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    results = bench.main(TINY_ARGS + ["--json", str(out), "--out", str(tmp_path)])

    shapes = results["shapes"]
    assert [(s["num_docs"], s["doc_tokens"]) for s in shapes] == [(2, 64), (3, 64)]
    assert shapes[0]["sweeps"] == ["a", "b"] and shapes[1]["sweeps"] == ["b"]
    leading, question = len(bench.LEADING), len(bench.QUESTION)  # byte-level tokenizer: chars == tokens
    for shape in shapes:
        n = shape["num_docs"]
        assert shape["prompt_tokens"] == leading + n * 64 + question
        assert isinstance(shape["speedup"], float) and shape["speedup"] > 0 and math.isfinite(shape["speedup"])
        assert shape["speedup"] == pytest.approx(shape["full_ttft_ms"] / shape["hypic_ttft_ms"])
        assert shape["segments_hit"] == n
        assert shape["hypic_recomputed_tokens"] < shape["full_recomputed_tokens"] == shape["prompt_tokens"]
        assert shape["hypic_recomputed_tokens"] == leading + n * 2 * 8 + question  # L, seams (w = 8) and Q
        assert shape["hypic_cached_tokens"] == n * (64 - 2 * 8)
        assert len(shape["full_samples_ms"]) == len(shape["hypic_samples_ms"]) == 1

    slopes = results["slopes"]
    assert set(slopes) == {"full_ms_per_doc", "hypic_ms_per_doc", "ratio"}
    assert all(isinstance(v, float) for v in slopes.values())
    # 2-3 documents of 64 tokens are not the sizes the targets are defined for (16k-token prompts)
    assert [t["passed"] for t in results["targets"]] == [None, None] and results["all_passed"] is False
    assert results["environment"]["threads"] == 1 and results["wall_s"] > 0

    printed = capsys.readouterr().out
    assert "speedup" in printed and "ms/doc" in printed
    assert printed.count("NOT JUDGED:") == 2 and "PASS:" not in printed and "FAIL:" not in printed
    written = json.loads(out.read_text())
    assert written["shapes"][0]["label"] == "2x64"


def test_slope_and_shapes(bench: ModuleType) -> None:
    assert bench.least_squares_slope([4, 8, 16], [10.0, 20.0, 40.0]) == pytest.approx(2.5)
    assert bench.least_squares_slope([4, 4], [1.0, 2.0]) is None
    shapes = bench.build_shapes(bench.parse_args([]))
    assert [s.label for s in shapes] == ["4x1k", "4x2k", "4x4k", "8x1k", "16x1k"]
    assert shapes[0].sweeps == ("a", "b")
    quick = bench.build_shapes(bench.parse_args(["--quick"]))
    assert [(s.num_docs, s.doc_tokens) for s in quick] == [(4, 256), (4, 512), (4, 1024), (8, 256), (16, 256)]
