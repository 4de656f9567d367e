"""eval/bench_real_shapes.py: the preset is Qwen3.5-35B-A3B's shapes (counted against transformers'
own model of that config, built without memory), and a smoke run of the sweeps on a tiny preset."""
from types import ModuleType

import pytest
import torch

from .conftest import load_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_real_shapes")


def test_preset_has_the_checkpoint_parameter_count(bench: ModuleType) -> None:
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    fields = {k: v for k, v in bench.QWEN35_35B_A3B.items() if k != "model_type"}
    with torch.device("meta"):
        reference = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields))
        ours = bench.HybridModel(bench.parse_config(bench.QWEN35_35B_A3B))
    count = lambda model: sum(p.numel() for p in model.parameters())  # noqa: E731
    assert count(ours) == count(reference)
    assert 34e9 < count(ours) < 36e9  # "35B total, 3B active"


def test_tiny_preset_smoke_run(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    results = bench.main(["--preset", "tiny-moe", "--device", "cpu", "--repeats", "1", "--quick", "--doc-lengths", "64",
                          "--doc-counts", "2", "3", "--no-progress"])
    shapes = results["shapes"]
    assert [(s["num_docs"], s["doc_tokens"]) for s in shapes] == [(4, 64), (2, 256), (3, 256)]
    for shape in shapes:
        assert shape["segments_hit"] == shape["num_docs"]
        assert shape["hypic_recomputed_tokens"] == 32 + shape["num_docs"] * 2 * 8 + 32  # L, seams, Q
    assert results["environment"]["layers"] == 4
    printed = capsys.readouterr().out
    assert "paper full s" in printed and "per extra document" in printed
