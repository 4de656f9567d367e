"""eval/accuracy_sweep.py on a tiny random checkpoint: exactness where the algebra says so."""
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from hypic import Engine
from hypic_data.synthetic_qa import GeneratorConfig, build_prompt, generate_example, to_json_line

from .conftest import load_script


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    return load_script("accuracy_sweep")


def _short_examples(count: int) -> list[dict]:
    """Synthetic examples cut to 3 documents of 90 characters (92 byte-level tokens each)."""
    examples = []
    for index in range(count):
        example = generate_example(GeneratorConfig(), "test", index)
        examples.append({**example, "documents": [doc[:90].rstrip() for doc in example["documents"][:3]]})
    return examples


def test_sweep_on_tiny_checkpoint(sweep: ModuleType, tiny_checkpoint: Path, tmp_path: Path) -> None:
    examples = _short_examples(10)
    engine = Engine.from_pretrained(tiny_checkpoint)
    for example in examples:  # the gold answer is full recompute's own greedy answer
        example["answer"] = sweep.answer_greedily(engine, build_prompt(example), "full", 4)[0]
    (tmp_path / "test.jsonl").write_text("".join(to_json_line(e) for e in examples), encoding="utf-8")
    out, markdown = tmp_path / "sweep.json", tmp_path / "sweep.md"
    summary = sweep.main(["--model", str(tiny_checkpoint), "--data", str(tmp_path), "--limit", "2",
                          "--widths", "4", "64", "--max-new-tokens", "4", "--no-progress",
                          "--json", str(out), "--markdown", str(markdown)])

    configs = summary["configs"]
    assert list(configs) == ["full", "hypic w=4", "hypic w=64", "prefix", "naive"]
    assert all(c["total"] == {"single_hop": 2, "multi_hop": 2} for c in configs.values())
    assert configs["full"]["accuracy"]["overall"] == 1.0
    # w=64: no 92-token document has an interior, so nothing is spliced: identical to full
    exact = configs["hypic w=64"]
    assert exact["accuracy"] == configs["full"]["accuracy"] and exact["agreement_with_full"] == 1.0
    assert max(exact["drift_rel_l2"]) <= 1e-5 and max(exact["drift_angle_deg"]) <= 1e-3
    assert max(configs["prefix"]["drift_rel_l2"]) <= 1e-5 and configs["prefix"]["agreement_with_full"] == 1.0
    # w=4: the first linear layer composes exactly; deeper layers drift (isolated-prefill inputs)
    spliced = configs["hypic w=4"]
    assert len(spliced["drift_rel_l2"]) == 3  # 4 layers: 3 Gated DeltaNet + 1 attention
    assert spliced["drift_rel_l2"][0] <= 1e-5 < spliced["drift_rel_l2"][-1]
    assert configs["naive"]["drift_rel_l2"][0] >= 0.05  # no transition operator: structural error
    assert configs["naive"]["drift_angle_deg"][0] > spliced["drift_angle_deg"][0]

    written = json.loads(out.read_text())
    assert written["configs"]["full"]["correct"] == {"single_hop": 2, "multi_hop": 2}
    assert len(written["predictions"]) == 4 and written["threads"] == 1
    table = markdown.read_text()
    assert "| hypic w=4 |" in table and "single-hop" in table and "layer 2 rel L2" in table


def test_select_examples_takes_first_n_of_each_kind(sweep: ModuleType) -> None:
    examples = [{"kind": k, "i": i} for i, k in enumerate(["single_hop", "multi_hop", "single_hop", "single_hop"])]
    assert [e["i"] for e in sweep.select_examples(examples, 1)] == [0, 1]
    assert [e["i"] for e in sweep.select_examples(examples, None)] == [0, 1, 2, 3]


def test_state_drift_values(sweep: ModuleType) -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    (rel, angle), (rel_same, angle_same) = sweep.state_drift([a, b], [b, b])
    assert rel == pytest.approx(math.sqrt(2)) and angle == pytest.approx(90.0)
    assert rel_same == 0.0 and angle_same == 0.0


def test_modes_select_configurations_and_full_always_runs(sweep: ModuleType) -> None:
    labels = lambda configs: [c.label for c in configs]  # noqa: E731
    assert labels(sweep.sweep_configs([4, 8])) == ["full", "hypic w=4", "hypic w=8", "prefix", "naive"]
    assert labels(sweep.sweep_configs([4, 8], ["naive"])) == ["full", "naive"]
    assert labels(sweep.sweep_configs([4], ["full"])) == ["full"]
