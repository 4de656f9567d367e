"""The default model shipped in the package: a valid HF checkpoint that answers."""
import json

import pytest
import torch

import hypic.loading.default_model as default_model
from hypic import CheckpointError, Engine, default_model_path
from hypic.loading.checkpoints import reference_classes
from hypic_data.evaluate import exact_match
from hypic_data.synthetic_qa import GeneratorConfig, build_prompt, generate_example

# A held-out test example (regenerated from its seed: test-000020, 11 documents, single-hop,
# answer "pharmacist") that the shipped model answers correctly under full recompute. It answers
# 96 % of the split's first 100 single-hop questions: see eval/results/accuracy_default_model.md.
TEST_INDEX = 20
HELD_OUT_SINGLE_HOP = 20  # the first N single-hop test questions (the model answers 19 in full and in hypic)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("default", dtype="float32")  # the oracle computes in float32


@pytest.fixture(scope="module")
def example() -> dict:
    return generate_example(GeneratorConfig(), "test", TEST_INDEX)


def test_shipped_directory_is_a_small_qwen3_5_checkpoint() -> None:
    path = default_model_path()
    assert path.name == "default_model" and path.parent.name == "assets"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text"
    kinds = config["layer_types"]
    assert kinds.count("linear_attention") == 3 * kinds.count("full_attention") > 0
    assert sum(f.stat().st_size for f in path.iterdir()) <= 25 * 2**20


def test_transformers_logits_match_our_runtime(engine: Engine, example: dict) -> None:
    # The weights ship in bfloat16; both runtimes compute in float32 here.
    reference = reference_classes("qwen3_5_text")[1].from_pretrained(default_model_path(), dtype=torch.float32).eval()
    parameters = sum(p.numel() for p in reference.parameters())
    assert 5e6 <= parameters <= 20e6
    shorter = {**example, "documents": example["documents"][:3]}  # keeps the reference forward quick
    parts = engine.parse(build_prompt(shorter))
    with torch.no_grad():
        expected = reference(torch.tensor([parts.token_ids])).logits[0, -1].float()
    ours = engine.prefill(parts, "full").logits
    assert (ours - expected).abs().max().item() <= 1e-4
    assert int(ours.argmax()) == int(expected.argmax())


def test_default_model_answers_and_hypic_without_interior_equals_full(engine: Engine, example: dict) -> None:
    prompt = build_prompt(example)
    full = engine.generate(prompt, max_new_tokens=12, mode="full")
    assert exact_match(full.text, example["answer"]), (full.text, example["answer"])
    longest = max(len(engine.tokenizer.encode("\n\n" + doc)) for doc in example["documents"])
    wide = Engine(engine.model, engine.tokenizer, engine.fingerprint, seam_width=longest // 2 + 1)
    hypic = wide.generate(prompt, max_new_tokens=12, mode="hypic")
    assert hypic.segments_hit == hypic.segments_missed == 0  # no document has an interior
    assert hypic.output_ids == full.output_ids


def test_default_model_answers_held_out_questions_in_full_and_hypic(engine: Engine) -> None:
    """The gold answers of the test split are the oracle; both modes must clear 85 %."""
    examples = (generate_example(GeneratorConfig(), "test", i) for i in range(200))
    single_hop = [e for e in examples if e["kind"] == "single_hop"][:HELD_OUT_SINGLE_HOP]
    for mode in ("full", "hypic"):
        correct = sum(exact_match(engine.generate(build_prompt(e), max_new_tokens=12, mode=mode).text,
                                  e["answer"]) for e in single_hop)
        assert correct >= 0.85 * len(single_hop), (mode, correct)


def test_missing_default_model_is_a_checkpoint_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(CheckpointError, match="default model"):
        default_model_path()
    with pytest.raises(CheckpointError, match="default model"):
        Engine.from_pretrained("default")
