"""The synthetic multi-document QA generator: determinism, answer placement, sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from hypic_data.synthetic_qa import (
    DEFAULT_SEPARATOR,
    EOS_TOKEN,
    GeneratorConfig,
    build_prompt,
    build_training_text,
    example_problems,
    generate_example,
    generate_split,
    main,
)

FIELDS = ["id", "split", "kind", "instruction", "documents", "question", "answer",
          "supporting_docs"]
NAME = re.compile(r"\b[A-Z][a-z]+\b")


def has_phrase(text: str, phrase: str) -> bool:
    """Whole-word, case-insensitive occurrence (written here independently of the module)."""
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text, re.IGNORECASE) is not None


def all_examples(splits: dict[str, list[dict]]) -> list[dict]:
    """Every example of the fixture dataset."""
    return [ex for examples in splits.values() for ex in examples]


def run_cli(out: Path, seed: int, workers: int = 1) -> dict[str, bytes]:
    """Run the command line into ``out`` and return the bytes of each file."""
    main(["--out", str(out), "--train", "12", "--validation", "3", "--test", "4",
          "--seed", str(seed), "--workers", str(workers)])
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.jsonl"))}


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    first = run_cli(tmp_path / "a", seed=5)
    second = run_cli(tmp_path / "b", seed=5)
    other = run_cli(tmp_path / "c", seed=6)
    assert sorted(first) == ["test.jsonl", "train.jsonl", "validation.jsonl"]
    assert first == second
    assert all(first[name] != other[name] for name in first)


def test_splits_option_writes_only_those_splits_with_a_full_runs_bytes(tmp_path: Path) -> None:
    """``--splits test`` (what the evaluations read) writes test.jsonl alone, byte for byte the file
    a run of all three splits writes with the same seed; files of other splits are left as they were."""
    full = run_cli(tmp_path / "all", seed=5)
    assert [full[f"{split}.jsonl"].count(b"\n") for split in ("train", "validation", "test")] == [12, 3, 4]
    sizes = ["--train", "12", "--validation", "3", "--test", "4", "--seed", "5"]
    only = tmp_path / "only"
    main(["--out", str(only), *sizes, "--splits", "test"])
    assert {p.name: p.read_bytes() for p in only.glob("*.jsonl")} == {"test.jsonl": full["test.jsonl"]}
    main(["--out", str(only), *sizes, "--splits", "test", "validation"])
    assert {p.name: p.read_bytes() for p in only.glob("*.jsonl")} == {
        name: full[name] for name in ("test.jsonl", "validation.jsonl")}
    (only / "test.jsonl").write_text("kept\n")
    main(["--out", str(only), *sizes, "--splits", "validation"])
    assert (only / "test.jsonl").read_text() == "kept\n"


def test_worker_processes_give_the_same_bytes(tmp_path: Path) -> None:
    assert run_cli(tmp_path / "two", seed=5, workers=2) == run_cli(tmp_path / "one", seed=5)


def test_split_is_a_prefix_of_a_longer_split(qa_config: GeneratorConfig) -> None:
    assert list(generate_split(qa_config, "test", 3)) == list(generate_split(qa_config, "test", 6))[:3]


def test_fields_ids_and_kinds(splits: dict[str, list[dict]]) -> None:
    for split, examples in splits.items():
        for index, example in enumerate(examples):
            assert list(example) == FIELDS
            assert example["id"] == f"{split}-{index:06d}" and example["split"] == split
            assert example["kind"] in ("single_hop", "multi_hop")
    kinds = {ex["kind"] for ex in all_examples(splits)}
    assert kinds == {"single_hop", "multi_hop"}


def test_document_counts_within_range(splits: dict[str, list[dict]]) -> None:
    counts = [len(ex["documents"]) for ex in all_examples(splits)]
    assert min(counts) >= 4 and max(counts) <= 12
    assert len(set(counts)) > 3  # the range is actually used


def test_answers_are_short(splits: dict[str, list[dict]]) -> None:
    for example in all_examples(splits):
        assert 1 <= len(example["answer"].split()) <= 3, example["answer"]
        assert not has_phrase(example["question"], example["answer"])


def test_single_hop_answer_only_in_its_document(splits: dict[str, list[dict]]) -> None:
    for example in all_examples(splits):
        if example["kind"] != "single_hop":
            continue
        [support] = example["supporting_docs"]
        holders = [i for i, d in enumerate(example["documents"]) if has_phrase(d, example["answer"])]
        assert holders == [support], example["id"]


def test_multi_hop_answer_only_in_the_answer_document(splits: dict[str, list[dict]]) -> None:
    for example in all_examples(splits):
        if example["kind"] != "multi_hop":
            continue
        bridge_doc, answer_doc = example["supporting_docs"]
        holders = [i for i, d in enumerate(example["documents"]) if has_phrase(d, example["answer"])]
        assert holders == [answer_doc], example["id"]
        assert bridge_doc != answer_doc


def test_multi_hop_needs_both_documents(splits: dict[str, list[dict]]) -> None:
    for example in all_examples(splits):
        if example["kind"] != "multi_hop":
            continue
        first, second = (example["documents"][i] for i in example["supporting_docs"])
        asked = set(NAME.findall(example["question"])) - {"What", "Which", "Who", "Where", "In",
                                                          "How"}
        # The entity the question names is in the first document and not in the second ...
        assert any(has_phrase(first, n) and not has_phrase(second, n) for n in asked), example["id"]
        # ... and a bridge entity absent from the question links the two documents.
        shared = set(NAME.findall(first)) & set(NAME.findall(second)) - asked - {"The"}
        assert any(has_phrase(first, n) and has_phrase(second, n) for n in shared), example["id"]


def test_documents_have_at_least_64_tokens(splits: dict[str, list[dict]],
                                           tokenizer_file: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    sizes = [len(tokenizer.encode(doc, add_special_tokens=False).ids)
             for ex in all_examples(splits) for doc in ex["documents"]]
    assert min(sizes) >= 64
    words = [len(doc.split()) for ex in all_examples(splits) for doc in ex["documents"]]
    assert min(words) >= 80 and max(words) <= 200


def test_splits_do_not_share_documents_or_questions(splits: dict[str, list[dict]]) -> None:
    train_docs = {doc for ex in splits["train"] for doc in ex["documents"]}
    train_qa = {(ex["question"], ex["answer"]) for ex in splits["train"]}
    for split in ("validation", "test"):
        assert not train_docs & {doc for ex in splits[split] for doc in ex["documents"]}
        assert not train_qa & {(ex["question"], ex["answer"]) for ex in splits[split]}


def test_prompt_and_training_text(splits: dict[str, list[dict]]) -> None:
    example = splits["test"][0]
    parts = build_prompt(example).split(DEFAULT_SEPARATOR)
    assert len(parts) == len(example["documents"]) + 2
    assert parts[0] == example["instruction"]
    assert [p.strip() for p in parts[1:-1]] == example["documents"]
    assert parts[-1] == f"\n\nQuestion: {example['question']}\nAnswer:"
    expected = "".join(parts) + " " + example["answer"] + EOS_TOKEN
    assert build_training_text(example) == expected
    assert build_prompt(example, separator="|SEP|").count("|SEP|") == len(parts) - 1


def test_checker_rejects_an_answer_leaked_to_a_distractor(qa_config: GeneratorConfig) -> None:
    example = generate_example(qa_config, "validation", 1)
    docs = list(example["documents"])
    distractor = next(i for i in range(len(docs)) if i not in example["supporting_docs"])
    docs[distractor] += f" Some say {example['answer']}."
    assert example_problems(example["kind"], example["documents"], example["question"],
                            example["answer"], example["supporting_docs"]) == []
    assert example_problems(example["kind"], docs, example["question"], example["answer"],
                            example["supporting_docs"])


def test_cli_help_explains(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--out", "--train", "--validation", "--test", "--seed", "--splits"):
        assert option in text


def test_extra_questions_are_valid_and_leave_the_example_unchanged(qa_config) -> None:
    from dataclasses import replace

    with_extra = replace(qa_config, extra_questions=5)
    for index in range(6):
        plain = generate_example(qa_config, "train", index)
        rich = generate_example(with_extra, "train", index)
        extras = rich.pop("extra_questions")
        assert rich == plain and 1 <= len(extras) <= 5
        assert len({e["question"] for e in extras} | {plain["question"]}) == len(extras) + 1
        for extra in extras:
            assert not example_problems(extra["kind"], plain["documents"], extra["question"],
                                        extra["answer"], extra["supporting_docs"])
            holders = [i for i, doc in enumerate(plain["documents"]) if has_phrase(doc, extra["answer"])]
            assert holders == [extra["supporting_docs"][-1]]
