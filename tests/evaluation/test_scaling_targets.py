"""``hypic eval scaling``'s targets are judged only at the sizes they are defined for (16k-token
prompts; sweep (b) of 4, 8, 16 documents x 1k tokens): fake measurements from a closed-form TTFT
model, recorded as if measured, so nothing is timed and the verdicts are known in advance."""
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

import hypic.evaluation.scaling as scaling
from hypic.cli import main

LEAD_AND_QUESTION = 64  # tokens of L and Q around the documents (byte-level tokenizer)


def _full_ms(prompt_tokens: int) -> float:
    """Fake full-recompute TTFT: quadratic attention plus linear work."""
    return 1e-5 * prompt_tokens ** 2 + 0.05 * prompt_tokens


def _hypic_ms(num_docs: int, slowness: float) -> float:
    """Fake hypic TTFT: a fixed part and 0.5 ms per spliced document, times ``slowness``."""
    return slowness * (20.0 + 0.5 * num_docs)


def _fake(shape: scaling.Shape, slowness: float) -> scaling.ShapeResult:
    prompt = LEAD_AND_QUESTION + shape.num_docs * shape.doc_tokens
    full, hypic = _full_ms(prompt), _hypic_ms(shape.num_docs, slowness)
    return scaling.ShapeResult(
        label=shape.label, sweeps=list(shape.sweeps), num_docs=shape.num_docs, doc_tokens=shape.doc_tokens,
        prompt_tokens=prompt, full_ttft_ms=full, hypic_ttft_ms=hypic, speedup=full / hypic,
        segments_hit=shape.num_docs, hypic_cached_tokens=0, hypic_recomputed_tokens=0, hypic_combine_tokens=0,
        full_recomputed_tokens=prompt, warmup_s=0.0)


def _shapes(options: list[str]) -> list[scaling.Shape]:
    return scaling.build_shapes(scaling.parse_args(options))


def _oracle(doc_tokens: int, longest: int, slowness: float) -> tuple[float, float]:
    """(worst speed-up at ``longest`` document tokens: 16 x 1k or 4 x 4k, scaled by ``doc_tokens``;
    least-squares slope ratio over 4, 8, 16 documents of ``doc_tokens``), recomputed with numpy."""
    prompt = LEAD_AND_QUESTION + longest
    speedup = _full_ms(prompt) / _hypic_ms(16, slowness)  # 16 x doc_tokens: the slower hypic of the two
    counts = np.array([4, 8, 16])
    full = np.polyfit(counts, [_full_ms(LEAD_AND_QUESTION + n * doc_tokens) for n in counts], 1)[0]
    hypic = np.polyfit(counts, [_hypic_ms(n, slowness) for n in counts], 1)[0]
    return speedup, full / hypic


@pytest.mark.parametrize("slowness, passes", [(1.0, True), (30.0, False)])
def test_full_size_results_are_judged(slowness: float, passes: bool) -> None:
    verdict = scaling.judge([_fake(s, slowness) for s in _shapes([])])
    speedup, ratio = _oracle(1024, 16 * 1024, slowness)
    assert [speedup >= 10, ratio >= 20] == [passes, passes]  # the fake numbers are on the side meant
    values = [t["value"] for t in verdict["targets"]]
    assert values == [pytest.approx(speedup), pytest.approx(ratio)]
    assert [t["passed"] for t in verdict["targets"]] == [passes, passes] and verdict["all_passed"] == passes


def test_quick_results_are_not_judged() -> None:
    quick = _shapes(["--quick"])
    assert max(s.num_docs * s.doc_tokens for s in quick) == 16 * 1024 // 4
    verdict = scaling.judge([_fake(s, 1.0) for s in quick])
    speedup, ratio = _oracle(256, 4 * 1024, 1.0)
    assert [t["value"] for t in verdict["targets"]] == [pytest.approx(speedup), pytest.approx(ratio)]  # shown
    assert [t["passed"] for t in verdict["targets"]] == [None, None] and verdict["all_passed"] is False
    lines = scaling.format_targets([scaling.Target(**t) for t in verdict["targets"]]).splitlines()
    assert len(lines) == 2 and all(line.startswith("NOT JUDGED:") for line in lines)
    assert all("not judged: target defined for" in line and "16384-token prompts" in line for line in lines)
    assert "PASS" not in "".join(lines) and "FAIL" not in "".join(lines)


def test_each_target_is_judged_on_its_own_shapes() -> None:
    """4 x 4k alone is a 16k-token prompt (speed-up judged); sweep (b) stopping at 8 documents is not
    the sweep the slope target is defined for."""
    shapes = _shapes(["--doc-counts", "4", "8"])
    verdict = scaling.judge([_fake(s, 1.0) for s in shapes])
    assert [t["passed"] for t in verdict["targets"]] == [True, None] and verdict["all_passed"] is False


def _record(options: list[str], slowness: float, out: Path) -> None:
    """Write ``OUT/scaling.jsonl`` as a measured run with ``options`` would have (fake TTFTs)."""
    key = scaling.run_key(scaling.parse_args(options), "random qwen3_5_text")
    with (out / "scaling.jsonl").open("w") as handle:
        for shape in _shapes(options):
            record = {"dataset": key, "sample": shape.label, "method": "hypic:8",
                      "result": asdict(_fake(shape, slowness))}
            handle.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("size, status, passed", [(["--quick"], 1, [None, None]), ([], 0, [True, True])])
def test_recorded_run_summary_and_strict_exit(size: list[str], status: int, passed: list[bool | None],
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``hypic eval scaling`` on recorded shapes: the summary marks the targets only at full size, and
    --strict exits 1 for a quick run (nothing shown met) and 0 for a passing full-size one."""
    def refuse(*_: object) -> None:
        raise AssertionError("a recorded shape was measured")

    monkeypatch.setattr(scaling, "measure_shape", refuse)
    options = [*size, "--no-progress", "--out", str(tmp_path)]
    _record(options, 1.0, tmp_path)
    assert main(["eval", "scaling", *options, "--strict"]) == status
    summary = json.loads((tmp_path / "scaling_summary.json").read_text())
    assert [t["passed"] for t in summary["targets"]] == passed
    printed = capsys.readouterr().out
    assert printed.count("NOT JUDGED:") == passed.count(None) and printed.count("PASS:") == passed.count(True)
