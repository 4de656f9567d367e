"""Training of the small hybrid model, and the evaluation harness, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hypic.data.evaluate import EvalReport, evaluate, exact_match, transformers_answer_fn
from hypic.data.tokenizer import load_tokenizer
from hypic.data.train import (
    IGNORE_INDEX,
    Encoded,
    ModelConfig,
    batch_order,
    build_model,
    count_parameters,
    fit_to_length,
    lr_factor,
    make_batch,
    qa_loss,
)


def test_micro_training_lowers_the_loss(micro_run) -> None:
    config, result = micro_run
    assert result.steps == config.steps and not result.stopped_early
    first, last = sum(result.losses[:2]) / 2, sum(result.losses[-2:]) / 2
    assert last < first - 0.5, result.losses


def test_run_saves_checkpoints_with_tokenizer(micro_run) -> None:
    config, result = micro_run
    out = Path(result.out)
    for directory in (out, *out.glob("checkpoint-*")):
        for name in ("config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json", "training_config.json"):
            assert (directory / name).is_file(), directory / name
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-000008"]  # keep 1
    log = (out / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in log] == list(range(1, config.steps + 1))


def test_saved_model_is_the_qwen3_5_hybrid(micro_run) -> None:
    _, result = micro_run
    hf = json.loads((Path(result.out) / "config.json").read_text())
    assert hf["model_type"] == "qwen3_5_text"
    assert hf["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert hf["linear_num_value_heads"] == 2 * hf["linear_num_key_heads"]
    assert hf["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_default_model_size_is_5_to_20_million(one_torch_thread) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(), eos_id=0, pad_id=1, device=torch.device("cpu"))
    assert 5e6 <= count_parameters(model) <= 20e6
    types = model.config.layer_types
    assert types.count("linear_attention") == 3 * types.count("full_attention")


def test_fit_to_length_keeps_supporting_documents(splits, tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_file)
    example = max(splits["train"], key=lambda ex: len(ex["documents"]))
    full = fit_to_length(tokenizer, example, 0, 10**6)
    short = fit_to_length(tokenizer, example, 0, 600)
    assert short is not None and len(short.ids) <= 600 < len(full.ids)
    assert full.ids[-1] == 0 and full.answer_start < len(full.ids) - 1  # answer, then eos
    kept = tokenizer.decode(short.ids[: short.answer_start])
    assert all(example["documents"][i] in kept for i in example["supporting_docs"])
    assert fit_to_length(tokenizer, example, 0, 50) is None


def test_batches_and_loss_masks() -> None:
    items = [Encoded([5, 6, 7, 8, 0], 3), Encoded([9, 10, 0], 2)]
    ids, labels, answer = make_batch(items, pad_id=1, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7, 8, 0], [9, 10, 0, 1, 1]]
    assert labels[1].tolist() == [9, 10, 0, IGNORE_INDEX, IGNORE_INDEX]
    assert answer.tolist() == [[False, False, False, True, True], [False, False, True, False, False]]
    logits = torch.zeros(2, 5, 16)
    total, lm, ans = qa_loss(logits, labels, answer, answer_weight=2.0)
    assert lm.item() == pytest.approx(torch.log(torch.tensor(16.0)).item())
    assert total.item() == pytest.approx(lm.item() + 2 * ans.item())


def test_schedule_and_order_are_reproducible() -> None:
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert batch_order(10, 3, seed=4) == batch_order(10, 3, seed=4)
    assert batch_order(10, 3, seed=4) != batch_order(10, 3, seed=5)
    assert all(len(batch) == 3 for batch in batch_order(10, 3, seed=4))


def question_of(prompt: str) -> str:
    """The question inside a prompt built by ``build_prompt``."""
    return prompt.rsplit("Question: ", 1)[1].removesuffix("\nAnswer:")


def test_evaluate_scores_by_kind(splits) -> None:
    examples = splits["validation"]
    answers = {ex["question"]: ex["answer"] for ex in examples}
    oracle = evaluate(examples, lambda prompt: f" {answers[question_of(prompt)]}\n")
    assert oracle.overall.accuracy == 1.0 and oracle.overall.total == len(examples)
    wrong = evaluate(examples, lambda prompt: "nothing")
    assert wrong.overall.correct == 0
    assert set(wrong.summary()) == {"overall"} | {ex["kind"] for ex in examples}
    assert exact_match(" Pitru River.", "pitru river") and not exact_match("Pitru", "Pitru River")


def test_transformers_backend_answers(micro_run, splits, one_torch_thread) -> None:
    _, result = micro_run
    answer_fn = transformers_answer_fn(result.out, device="cpu", max_new_tokens=3)
    report: EvalReport = evaluate(splits["validation"][:2], answer_fn)
    assert report.overall.total == 2
    assert all(isinstance(p["prediction"], str) for p in report.predictions)


def test_extra_questions_follow_the_answer_and_are_masked(splits, tokenizer_file: Path) -> None:
    from dataclasses import replace

    from hypic.data.synthetic_qa import GeneratorConfig, generate_example

    tokenizer = load_tokenizer(tokenizer_file)
    example = generate_example(replace(GeneratorConfig(), extra_questions=3), "train", 1)
    plain = fit_to_length(tokenizer, example, 0, 10**6)
    rich = fit_to_length(tokenizer, example, 0, 10**6, extra_questions=3)
    assert rich.ids[: len(plain.ids)] == plain.ids and plain.answer_spans == [(plain.answer_start, len(plain.ids))]
    spans = rich.answer_spans
    assert len(spans) == 1 + len(example["extra_questions"]) and spans[0] == (plain.answer_start, len(plain.ids))
    answers = [example["answer"]] + [e["answer"] for e in example["extra_questions"]]
    assert [tokenizer.decode(rich.ids[s:e]).strip() for s, e in spans] == answers
    assert all(rich.ids[e - 1] == 0 for _, e in spans)  # each answer ends with eos
    _, _, mask = make_batch([rich], 1, torch.device("cpu"))
    assert int(mask.sum()) == sum(e - s for s, e in spans)
    short = fit_to_length(tokenizer, example, 0, 500, extra_questions=3)  # distractors dropped
    assert short is not None and len(short.answer_spans) <= len(spans)


def test_long_memory_init_gives_slow_decay(one_torch_thread) -> None:
    from hypic.data.train import long_memory_init

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_hidden_layers=4), eos_id=0, pad_id=1, device=torch.device("cpu"))

    def decays() -> torch.Tensor:  # per-token state decay of each linear head at a = 0
        return torch.cat([torch.exp(-m.A_log.exp() * torch.nn.functional.softplus(m.dt_bias)).detach()
                          for m in model.modules() if hasattr(m, "dt_bias")])

    assert decays().median() < 0.01  # transformers' dt_bias = 1: forgotten within a few tokens
    long_memory_init(model)
    assert decays().median() > 0.5 and decays().max() > 0.99
