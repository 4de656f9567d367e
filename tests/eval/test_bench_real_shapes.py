"""eval/bench_real_shapes.py: the preset is Qwen3.5-35B-A3B's shapes (counted against transformers'
own model of that config, built without memory), and a smoke run of the sweeps on a tiny preset."""
from types import ModuleType, SimpleNamespace

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


def _event(name: str, device: bool, start: float, end: float, annotation: bool = False, cpu_us: float = 0.0,
           kernels_us: float = 0.0) -> SimpleNamespace:
    from torch.autograd import DeviceType
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA if device else DeviceType.CPU,
                           is_user_annotation=annotation, time_range=SimpleNamespace(start=start, end=end),
                           cpu_time_total=cpu_us, device_time_total=kernels_us)


def test_device_time_counts_kernels_once_and_not_annotation_spans(bench: ModuleType) -> None:
    """A profiler's events: the op that launched a kernel and the part's GPU-side range must not
    count as GPU work; busy time is the union of the kernels' intervals (10 + 15 us here)."""
    label = bench.PARTS[0][2]
    events = [_event(label, False, 0, 500, cpu_us=500, kernels_us=30),  # the part's CPU-side range
              _event("aten::mm", False, 10, 60, cpu_us=50, kernels_us=30),  # launches both kernels
              _event("gemm", True, 100, 110), _event("gemm", True, 105, 120),  # overlapping kernels
              _event(label, True, 100, 400, annotation=True)]  # its GPU-side span, idle gaps included
    kernel_ms, busy_ms = bench.device_activity(events)
    assert (kernel_ms, busy_ms) == (0.025, 0.02)
    part = bench.part_times(events)[label]
    assert part == {"calls": 1, "host_ms": 0.5, "kernel_ms": 0.03, "device_span_ms": 0.3}
