"""eval/bench_serving.py: the capacity interpolation in closed form, and a tiny end-to-end run."""
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_serving")


def _level(bench: ModuleType, qps: float, p50: float):
    return bench.LevelResult("m", qps, 10, 0, p50, p50, p50, 1.0, 1.0, 0.0, 1.0)


def test_qps_at_target_interpolates_log_linearly(bench: ModuleType) -> None:
    levels = [_level(bench, 1.0, 0.25), _level(bench, 4.0, 4.0)]
    # log p50 goes from log 0.25 to log 4 (4 halvings... i.e. factor 16) while log qps spans factor 4:
    # p50 = 1 is halfway in log space -> qps = 2
    assert bench.qps_at_target(levels, 1.0) == pytest.approx(2.0)
    assert bench.qps_at_target([_level(bench, 1.0, 2.0)], 1.0) is None
    assert bench.qps_at_target([_level(bench, 1.0, 0.1), _level(bench, 2.0, 0.2)], 1.0) == 2.0  # lower bound


def test_workload_is_deterministic_and_zipf_skewed(bench: ModuleType) -> None:
    args = bench._parser().parse_args(["--docs", "20", "--doc-words", "5"])
    workload = bench.make_workload(args)
    first, again = workload.prompts(200, 1), bench.make_workload(args).prompts(200, 1)
    assert first == again and first != workload.prompts(200, 2)
    counts = [sum(doc in p for p in first) for doc in workload.documents]
    assert counts[0] > 3 * counts[-1]  # rank 1 is far more popular than rank 20
    assert all(p.count(bench.DEFAULT_SEPARATOR) == 4 + 1 for p in first)  # L, 4 documents, Q


def test_shared_prefix_workload_is_plain_and_grouped(bench: ModuleType) -> None:
    args = bench._parser().parse_args(["--workload", "shared-prefix", "--groups", "3", "--system-words", "40"])
    workload = bench.make_workload(args)
    prompts = workload.prompts(60, 1)
    assert prompts == bench.make_workload(args).prompts(60, 1) and len(set(prompts)) == 60
    assert not any(bench.DEFAULT_SEPARATOR in p for p in prompts)
    assert {next(s for s in workload.systems if p.startswith(s)) for p in prompts} == set(workload.systems)


def test_tiny_run_against_real_servers(bench: ModuleType, tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = bench.main(["--model", str(tiny_checkpoint), "--modes", "hypic", "full", "--docs", "6", "--doc-words", "12",
                      "--warm-requests", "3", "--duration", "0.1", "--min-requests", "4", "--qps-start", "20", "--qps-factor", "2",
                      "--max-qps", "40", "--no-progress", "--json", str(tmp_path / "r.json")])
    modes = {m["mode"]: m for m in out["modes"]}
    assert set(modes) == {"hypic", "full"}
    for mode in modes.values():
        for level in mode["levels"]:
            assert level["failed"] == 0 and level["ttft_p50_s"] <= level["ttft_p90_s"] <= level["ttft_p99_s"]
    assert all(level["hit_rate"] == 0 for level in modes["full"]["levels"])
    assert all(level["hit_rate"] > 0.3 for level in modes["hypic"]["levels"])  # warm documents are spliced
    assert (tmp_path / "r.json").is_file()
