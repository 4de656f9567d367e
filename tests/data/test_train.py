"""Training of the small hybrid model, and the evaluation harness, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hypic_data.evaluate import EvalReport, evaluate, exact_match, transformers_answer_fn
from hypic_data.tokenizer import load_tokenizer
from hypic_data.train import (
    IGNORE_INDEX,
    Encoded,
    ModelConfig,
    batch_order,
    build_model,
    count_parameters,
    fit_to_length,
    load_model,
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
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, config.steps + 1))
    final = [r for r in log if "loss" not in r]  # the validation accuracy after the last step
    assert len(final) == 1 and final[0]["step"] == config.steps
    assert {"val_single_hop", "val_multi_hop"} <= set(final[0])


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

    from hypic_data.synthetic_qa import GeneratorConfig, generate_example

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
    from hypic_data.train import long_memory_init

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_hidden_layers=4), eos_id=0, pad_id=1, device=torch.device("cpu"))

    def decays() -> torch.Tensor:  # per-token state decay of each linear head at a = 0
        return torch.cat([torch.exp(-m.A_log.exp() * torch.nn.functional.softplus(m.dt_bias)).detach()
                          for m in model.modules() if hasattr(m, "dt_bias")])

    assert decays().median() < 0.01  # transformers' dt_bias = 1: forgotten within a few tokens
    long_memory_init(model)
    assert decays().median() > 0.5 and decays().max() > 0.99


def test_extra_kind_keeps_only_that_kind(tokenizer_file: Path) -> None:
    from dataclasses import replace

    from hypic_data.synthetic_qa import GeneratorConfig, generate_example

    tokenizer = load_tokenizer(tokenizer_file)
    example = generate_example(replace(GeneratorConfig(), extra_questions=12), "train", 2)
    single = [e["answer"] for e in example["extra_questions"] if e["kind"] == "single_hop"]
    assert 0 < len(single) < len(example["extra_questions"])  # the example mixes both kinds
    encoded = fit_to_length(tokenizer, example, 0, 10**6, extra_questions=12, extra_kind="single_hop")
    decoded = [tokenizer.decode(encoded.ids[s:e]).strip() for s, e in encoded.answer_spans[1:]]
    assert decoded == single
    with pytest.raises(ValueError, match="extra_kind"):
        fit_to_length(tokenizer, example, 0, 10**6, extra_questions=12, extra_kind="single")


def test_copy_drill_rows_repeat_a_random_run_and_join_the_batch() -> None:
    import random

    from hypic_data.train import _Batches, copy_drill

    drill = copy_drill(random.Random(3), range(10, 60), 8)
    assert drill.ids[:8] == drill.ids[8:] and drill.answer_spans == [(8, 16)]
    assert all(10 <= i < 60 for i in drill.ids)
    data = [Encoded([1, 2, 3, 4], 2)] * 6
    batches = _Batches(data, 2, seed=0, drill=(3, 5, range(10, 60)))
    batch = batches.next()
    assert len(batch) == 5 and [len(b.ids) for b in batch[2:]] == [10, 10, 10]
    again = _Batches(data, 2, seed=0, drill=(3, 5, range(10, 60))).next()
    assert [b.ids for b in again] == [b.ids for b in batch]  # seeded: reproducible


def test_plan_revision_bends_the_schedule(one_torch_thread) -> None:
    from hypic_data.train import StepPlan, TrainConfig, fitted_steps, make_optimizer

    config = TrainConfig(Path(), Path(), Path(), steps=1000, lr=1.0, warmup_steps=2,
                         min_lr_ratio=0.1, schedule_minutes=1.0)
    assert fitted_steps(config, done=20, elapsed_s=12.0, step_s=0.5) == 20 + 96  # 48 s left
    assert fitted_steps(config, done=20, elapsed_s=12.0, step_s=0.01) == 1000  # capped by steps
    assert fitted_steps(config, done=20, elapsed_s=70.0, step_s=0.5) == 21  # over time: stop
    plan = StepPlan(1000)
    optimizer, schedule = make_optimizer(torch.nn.Linear(2, 2), config, plan)
    for _ in range(5):
        optimizer.step()
        schedule.step()
    plan.total = 10
    for _ in range(5):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_factor(10, 2, 10, 0.1)) == 0.1


def test_greedy_answer_matches_agrees_with_generation(micro_run, splits, tokenizer_file: Path,
                                                      one_torch_thread) -> None:
    """The teacher-forced check says yes to the model's own greedy continuation, no to others."""
    from hypic_data.tokenizer import encode_parts
    from hypic_data.train import greedy_answer_matches
    from hypic_data.synthetic_qa import prompt_parts

    _, result = micro_run
    _, model = load_model(result.out, "cpu")
    tokenizer = load_tokenizer(tokenizer_file)
    items, flipped = [], []
    for example in splits["validation"][:3]:
        prompt = encode_parts(tokenizer, prompt_parts(example))
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                             do_sample=False, eos_token_id=0, pad_token_id=1)
        greedy = out[0, len(prompt):].tolist()  # ends early where it generates eos
        items.append(Encoded(prompt + greedy, len(prompt)))
        flipped.append(Encoded(prompt + greedy[:-1] + [(greedy[-1] + 1) % 4096], len(prompt)))
    device = torch.device("cpu")
    assert greedy_answer_matches(model, items, 1, device, batch_size=2) == [True] * 3
    assert greedy_answer_matches(model, flipped, 1, device, batch_size=2) == [False] * 3


def test_training_kernels_are_restored_on_exit() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from hypic_data.train import training_kernels
    from hypic.kernels.gated_delta.transformers_layout import transformers_chunk_gated_delta_rule

    original = modeling_qwen3_5.torch_chunk_gated_delta_rule
    with training_kernels(torch.device("cpu")):
        assert modeling_qwen3_5.torch_chunk_gated_delta_rule is transformers_chunk_gated_delta_rule
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is original


def test_encoding_in_worker_processes_gives_the_same_sequences(splits, tokenizer_file: Path) -> None:
    from hypic_data.train import encode_examples

    tokenizer = load_tokenizer(tokenizer_file)
    examples = splits["train"][:12]
    assert encode_examples(examples, tokenizer, 0, 700, workers=2) == \
        encode_examples(examples, tokenizer, 0, 700)


def test_export_casts_weights_and_both_runtimes_load_it(micro_run, splits, tmp_path: Path,
                                                       one_torch_thread) -> None:
    from safetensors.torch import load_file

    from hypic import Engine
    from hypic.loading.checkpoints import reference_classes
    from hypic_data.export import export_model
    from hypic_data.synthetic_qa import build_prompt

    _, result = micro_run
    out = export_model(Path(result.out), tmp_path / "shipped", "bfloat16")
    source, shipped = load_file(str(Path(result.out) / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(source) == set(shipped)
    assert all(shipped[k].dtype == torch.bfloat16 and torch.equal(shipped[k], source[k].bfloat16()) for k in source)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((out / "training.json").read_text())["steps"] == result.steps
    engine = Engine.from_pretrained(out, dtype="float32")  # bf16 weights computed as the oracle does
    reference = reference_classes("qwen3_5_text")[1].from_pretrained(out, dtype=torch.float32).eval()
    parts = engine.parse(build_prompt({**splits["test"][0], "documents": splits["test"][0]["documents"][:2]}))
    with torch.no_grad():
        expected = reference(torch.tensor([parts.token_ids])).logits[0, -1].float()
    assert (engine.prefill(parts, "full").logits - expected).abs().max().item() <= 1e-4
    # the evaluation loader computes in float32 unless told otherwise, whatever is stored
    assert {p.dtype for p in load_model(out, "cpu")[1].parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(out, "cpu", torch.bfloat16)[1].parameters()} == {torch.bfloat16}


def test_schedule_minutes_ends_the_run_and_its_schedule(micro_run, tmp_path: Path,
                                                        one_torch_thread) -> None:
    """A budget spent before the probe ends: the run stops right after it, at the schedule's end."""
    from dataclasses import replace

    from hypic_data.train import PROBE_STEPS, train

    config, _ = micro_run
    short = replace(config, out=tmp_path / "run", steps=40, schedule_minutes=1e-4, eval_examples=0,
                    save_every=0, warmup_steps=2)
    result = train(short)
    assert result.steps == PROBE_STEPS[1] + 1 and not result.stopped_early
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["lr"] == pytest.approx(short.lr * lr_factor(PROBE_STEPS[1], 2, PROBE_STEPS[1] + 1, 0.1))


def test_document_memory_heads_keep_their_decay_through_training(one_torch_thread) -> None:
    """Closed form: the fixed heads' log decay -exp(A_log) * softplus(in_proj_a x + dt_bias) is
    -memory_decay for any input, before and after AdamW steps with weight decay; other heads learn."""
    from hypic_data.train import StepPlan, TrainConfig, fix_document_memory, make_optimizer

    torch.manual_seed(0)
    model = build_model(ModelConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=96, head_dim=16,
                                    linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=300),
                        eos_id=0, pad_id=1, device=torch.device("cpu"))
    fix_document_memory(model, heads=3, decay=0.01)
    layers = [m for m in model.modules() if hasattr(m, "dt_bias")]
    before = [(m.A_log.detach().clone(), m.dt_bias.detach().clone(), m.in_proj_a.weight.detach().clone())
              for m in layers]
    optimizer, _ = make_optimizer(model, TrainConfig(Path(), Path(), Path(), lr=1e-2, warmup_steps=0), StepPlan(3))
    for _ in range(3):
        model(input_ids=torch.randint(2, 300, (2, 40))).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    x = torch.randn(5, 64)
    for layer, (a_log, dt_bias, weight) in zip(layers, before):
        log_decay = -layer.A_log.exp() * torch.nn.functional.softplus(layer.in_proj_a(x) + layer.dt_bias)
        assert torch.allclose(log_decay[:, :3], torch.full((5, 3), -0.01), rtol=1e-5)
        assert not torch.allclose(layer.in_proj_a.weight[3:], weight[3:])  # the other heads still learn
        assert torch.equal(layer.A_log[:3], a_log[:3]) and torch.equal(layer.dt_bias[:3], dt_bias[:3])
    with pytest.raises(ValueError):
        fix_document_memory(model, heads=99, decay=0.01)
