"""Exact-match accuracy of greedy answers on a synthetic QA split.

The scorer only needs a callable ``answer_fn(prompt_text) -> str`` that receives the
prompt with separators (``build_prompt``) and returns the generated answer text, so any
backend plugs in: ``transformers_answer_fn`` (transformers' model, full recompute, built
in here) or the HYPIC engine. Single-hop and multi-hop accuracies are reported apart.

Command line: ``python -m hypic_data.evaluate --model runs/tiny --split test``.
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypic_data.synthetic_qa import DEFAULT_SEPARATOR, build_prompt, read_jsonl

AnswerFn = Callable[[str], str]


@dataclass
class KindScore:
    """Correct and total counts of one question kind."""

    correct: int = 0
    total: int = 0

    @property
    def accuracy(self) -> float:
        """Fraction correct (0 when there were no questions)."""
        return self.correct / self.total if self.total else 0.0


@dataclass
class EvalReport:
    """Scores overall and per kind, plus every prediction."""

    by_kind: dict[str, KindScore] = field(default_factory=dict)
    predictions: list[dict] = field(default_factory=list)

    @property
    def overall(self) -> KindScore:
        """Scores summed over kinds."""
        return KindScore(sum(s.correct for s in self.by_kind.values()),
                         sum(s.total for s in self.by_kind.values()))

    def summary(self) -> dict:
        """Accuracies and counts as plain JSON values."""
        scores = {"overall": self.overall, **dict(sorted(self.by_kind.items()))}
        return {name: {"accuracy": round(s.accuracy, 4), "correct": s.correct, "total": s.total}
                for name, s in scores.items()}


def normalize_answer(text: str) -> str:
    """Lower-case, first line only, outer punctuation and extra spaces removed."""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    return re.sub(r"\s+", " ", first.strip().strip(string.punctuation + " ")).lower()


def exact_match(prediction: str, answer: str) -> bool:
    """Whether the normalized prediction equals the normalized gold answer."""
    return normalize_answer(prediction) == normalize_answer(answer)


def evaluate(examples: Iterable[dict], answer_fn: AnswerFn,
             separator: str = DEFAULT_SEPARATOR, progress: bool = False) -> EvalReport:
    """Ask ``answer_fn`` every example's prompt and score the answers."""
    from tqdm import tqdm

    examples = list(examples)
    report = EvalReport()
    for example in tqdm(examples, desc="eval", disable=not progress, file=sys.stderr):
        prediction = answer_fn(build_prompt(example, separator))
        correct = exact_match(prediction, example["answer"])
        score = report.by_kind.setdefault(example["kind"], KindScore())
        score.correct += int(correct)
        score.total += 1
        report.predictions.append({"id": example["id"], "kind": example["kind"],
                                   "answer": example["answer"], "prediction": prediction,
                                   "correct": correct})
    return report


def transformers_answer_fn(model_dir: str | Path, device: str = "auto",
                           max_new_tokens: int = 16, separator: str = DEFAULT_SEPARATOR,
                           dtype: str = "float32") -> AnswerFn:
    """Greedy answers from transformers' model in ``model_dir`` (full recompute).

    The prompt's parts are encoded one by one and concatenated, as the engine does, so
    both backends see the same token ids.
    """
    import torch

    from hypic_data.tokenizer import encode_parts, load_tokenizer, special_token_ids
    from hypic_data.train import load_model

    torch_device, model = load_model(model_dir, device, getattr(torch, dtype))
    tokenizer = load_tokenizer(model_dir)
    eos_id, pad_id = special_token_ids(tokenizer)

    @torch.inference_mode()
    def answer(prompt: str) -> str:
        ids = torch.tensor([encode_parts(tokenizer, prompt.split(separator))], device=torch_device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=pad_id)
        return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)

    return answer


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(
        prog="python -m hypic_data.evaluate",
        description="Exact-match accuracy of greedy answers of a trained model on a synthetic "
                    "QA split, with transformers' model (full recompute), reported overall, "
                    "single-hop and multi-hop.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", type=Path, required=True,
                        help="directory with config.json, model.safetensors, tokenizer.json")
    parser.add_argument("--data", type=Path, default=Path("datasets/synthetic_qa"))
    parser.add_argument("--split", default="test", choices=("train", "validation", "test"))
    parser.add_argument("--limit", type=int, default=None, help="score only the first N")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="compute dtype, whatever the weights are stored in")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the summary and every prediction to this JSON file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the command line."""
    args = _parse_args(argv)
    examples = read_jsonl(args.data / f"{args.split}.jsonl")[: args.limit]
    answer_fn = transformers_answer_fn(args.model, args.device, args.max_new_tokens,
                                       dtype=args.dtype)
    report = evaluate(examples, answer_fn, progress=True)
    print(json.dumps(report.summary(), indent=2))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"summary": report.summary(), "predictions": report.predictions}
        args.out.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
