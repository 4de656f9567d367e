"""Samples of a study: LongBench-format JSONL from a local path, or the synthetic multi-document QA.

A sample's prompt is ``instruction SEP doc_1 SEP ... SEP doc_n SEP question part``: each document
a PIC segment (it starts with a blank line, so that byte-level BPE never merges across parts).
LongBench contexts are split at their passage markers (lines ``Passage 1:``, ``Document 2:``,
``Paragraph 3:`` or ``Passage:``); a context without markers is cut into pieces of about
``chunk_words`` words at paragraph ends (the token-count fallback). Nothing is downloaded.
"""
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypic import DEFAULT_SEPARATOR

MARKER = re.compile(r"^(?:Passage|Document|Paragraph)(?: \d+)?:[ \t]*$|^(?:Passage|Document|Paragraph) \d+:", re.M)
QA_TASK = ("Answer the question from the passages below. Reply with the answer only.",
           "\n\nQuestion: {input}\nAnswer:", "f1", 32)
SUMMARY_TASK = ("Write a one-paragraph summary of the documents below.", "\n\nSummary:", "rouge_l", 200)
LONGBENCH_TASKS = {"hotpotqa": QA_TASK, "2wikimqa": QA_TASK, "musique": QA_TASK, "triviaqa": QA_TASK,
                   "multi_news": SUMMARY_TASK, "gov_report": SUMMARY_TASK}
DATASETS = (*LONGBENCH_TASKS, "synthetic")


class DataError(ValueError):
    """A dataset that cannot be read, named with the file and line at fault."""


@dataclass(frozen=True)
class Sample:
    """One request of a study and how to score its answer."""

    id: str
    dataset: str
    instruction: str
    documents: tuple[str, ...]
    question: str  # the trailing part, always recomputed
    answers: tuple[str, ...]
    metric: str  # a key of metrics.METRICS
    max_new_tokens: int
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def prompt(self, separator: str = DEFAULT_SEPARATOR) -> str:
        return separator.join([self.instruction, *self.documents, self.question])

    def earlier_prompts(self, separator: str = DEFAULT_SEPARATOR) -> list[str]:
        """Prompts that showed this sample's documents before it, each document in one of its own
        after the instruction: documents seen before in other prompts, not this prompt again (of
        which a prefix cache then holds the instruction and the first document)."""
        return [separator.join([self.instruction, document]) for document in self.documents]


def split_context(context: str, chunk_words: int = 400) -> list[str]:
    """Documents of a LongBench context: at its passage markers, else pieces of about ``chunk_words``
    words ending at paragraph ends. Each starts with a blank line."""
    starts = [m.start() for m in MARKER.finditer(context)]
    if starts:
        pieces = [context[a:b] for a, b in zip(starts, [*starts[1:], len(context)])]
        head = context[: starts[0]].strip()
        pieces = ([head] if head else []) + pieces
    else:
        pieces = _by_length(context, chunk_words)
    return ["\n\n" + piece.strip() for piece in pieces if piece.strip()]


def _by_length(text: str, chunk_words: int) -> list[str]:
    pieces, current, words = [], [], 0
    for paragraph in re.split(r"\n\s*\n", text):
        current.append(paragraph)
        words += len(paragraph.split())
        if words >= chunk_words:
            pieces.append("\n\n".join(current))
            current, words = [], 0
    return pieces + (["\n\n".join(current)] if current else [])


def _records(path: Path) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: a line must be a JSON object")
        records.append((number, record))
    return records


def load_longbench(path: Path, dataset: str, chunk_words: int = 400) -> list[Sample]:
    """LongBench-format JSONL (``input``, ``context``, ``answers``; ``_id`` if present) of ``dataset``."""
    if dataset not in LONGBENCH_TASKS:
        raise DataError(f"unknown LongBench dataset {dataset!r}: one of {', '.join(LONGBENCH_TASKS)}")
    instruction, question, metric, max_new = LONGBENCH_TASKS[dataset]
    samples = []
    for number, record in _records(path):
        missing = [key for key in ("input", "context", "answers") if key not in record]
        if missing or not isinstance(record.get("answers"), list):
            raise DataError(f"{path}:{number}: needs 'input', 'context' and a list 'answers' (missing {missing})")
        samples.append(Sample(str(record.get("_id", f"{dataset}-{number}")), dataset, instruction,
                              tuple(split_context(record["context"], chunk_words)),
                              question.format(input=record["input"]), tuple(record["answers"]), metric, max_new))
    return samples


def load_synthetic(path: Path) -> list[Sample]:
    """The synthetic multi-document QA (``datasets/synthetic_qa/<split>.jsonl``), scored by exact match."""
    from hypic_data.synthetic_qa import prompt_parts
    samples = []
    for number, record in _records(path):
        try:
            parts = prompt_parts(record)
            samples.append(Sample(record["id"], "synthetic", parts[0], tuple(parts[1:-1]), parts[-1],
                                  (record["answer"],), "exact_match", 12, {"kind": record["kind"]}))
        except (KeyError, TypeError) as err:
            raise DataError(f"{path}:{number}: not a synthetic QA example ({err!r})") from None
    return samples


def load(dataset: str, path: Path, limit: int | None = None, chunk_words: int = 400) -> list[Sample]:
    """The first ``limit`` samples of ``dataset`` read from ``path``."""
    samples = load_synthetic(path) if dataset == "synthetic" else load_longbench(path, dataset, chunk_words)
    return samples[:limit] if limit is not None else samples
