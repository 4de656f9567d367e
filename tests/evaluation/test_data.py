"""Loaders on the fixture files of datasets/longbench_fixtures (nothing is downloaded)."""
import json
from pathlib import Path

import pytest

from hypic.evaluation.data import DataError, load, split_context

FIXTURES = Path(__file__).resolve().parents[2] / "datasets" / "longbench_fixtures"


def test_passages_split_at_their_markers() -> None:
    (first, second) = load("hotpotqa", FIXTURES / "hotpotqa.jsonl")
    assert first.id == "fixture-hotpot-1" and first.answers == ("Sarn River",) and first.metric == "f1"
    assert len(first.documents) == 3 and len(second.documents) == 2
    assert [d.splitlines()[2] for d in first.documents] == ["Passage 1:", "Passage 2:", "Passage 3:"]
    assert first.documents[1].endswith("Sarn River.")
    assert first.question.endswith("Which river runs through the city where Alma Verk was born?\nAnswer:")
    parts = first.prompt().split("<<PIC_SEP>>")
    assert parts[1:-1] == list(first.documents) and all(d.startswith("\n\n") for d in first.documents)


def test_context_without_markers_falls_back_to_word_counts() -> None:
    (report,) = load("gov_report", FIXTURES / "gov_report.jsonl", chunk_words=50)
    paragraphs = json.loads((FIXTURES / "gov_report.jsonl").read_text())["context"].split("\n\n")
    assert len(paragraphs) == 7  # 30 words each: pieces close after 2 paragraphs (60 >= 50 words)
    assert len(report.documents) == 4 and report.metric == "rouge_l"
    assert "".join(report.documents).split() == " ".join(paragraphs).split()  # nothing lost or repeated


def test_text_before_the_first_marker_is_its_own_document() -> None:
    assert split_context("Intro text.\nPassage 1:\nOne.\nPassage 2:\nTwo.") == \
        ["\n\nIntro text.", "\n\nPassage 1:\nOne.", "\n\nPassage 2:\nTwo."]


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load("hotpotqa", tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl"
    broken.write_text((FIXTURES / "hotpotqa.jsonl").read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(DataError, match="broken.jsonl:2: not valid JSON"):
        load("hotpotqa", broken)
    broken.write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(DataError, match="broken.jsonl:1: needs"):
        load("hotpotqa", broken)
    with pytest.raises(DataError, match="unknown LongBench dataset"):
        load("narrativeqa", broken)
