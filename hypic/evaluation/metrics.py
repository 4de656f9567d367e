"""Answer metrics (exact match, token F1, ROUGE-L), where two greedy outputs part, and state drift."""
import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from functools import cache

import torch

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = frozenset(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD / LongBench normalisation: lower case, punctuation and the articles a, an, the removed,
    whitespace collapsed."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer."""
    return float(any(normalize(prediction) == normalize(answer) for answer in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """The best F1 over the gold answers of the normalised tokens' multiset overlap."""
    return max((_f1(normalize(prediction).split(), normalize(answer).split()) for answer in answers), default=0.0)


def _f1(predicted: list[str], gold: list[str]) -> float:
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


@cache
def _rouge_scorer():
    from rouge_score import rouge_scorer
    return rouge_scorer.RougeScorer(["rougeL"])


def rouge_l(prediction: str, answers: Sequence[str]) -> float:
    """The best ROUGE-L F-measure over the gold answers (rouge-score's implementation)."""
    return max((_rouge_scorer().score(answer, prediction)["rougeL"].fmeasure for answer in answers), default=0.0)


METRICS = {"exact_match": exact_match, "f1": token_f1, "rouge_l": rouge_l}


def first_divergence(ours: Sequence[int], reference: Sequence[int]) -> int | None:
    """The index of the first token where two outputs differ (a length difference counts); None if equal."""
    for index, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return index
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def state_drift(states: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> list[tuple[float, float]]:
    """(relative L2 error, angle in degrees) of each state against its reference, flattened.

    The angle uses 2 atan2(|a^ - b^|, |a^ + b^|) on the unit vectors, which stays accurate
    near 0 (where acos of the cosine would not)."""
    out = []
    for state, ref in zip(states, reference):
        a, b = state.double().flatten(), ref.double().flatten()
        rel = ((a - b).norm() / b.norm()).item() if b.norm() > 0 else float((a - b).norm() > 0)
        ua, ub = a / a.norm().clamp_min(1e-300), b / b.norm().clamp_min(1e-300)
        angle = math.degrees(2 * math.atan2((ua - ub).norm().item(), (ua + ub).norm().item()))
        out.append((rel, angle))
    return out
