"""The documented logits-processing rules, one token at a time: the oracle of the sampling tests.

HF/CTRL repetition penalty over prompt and output tokens (positive logits divided by it, negative
multiplied), OpenAI's frequency and presence penalties over the output, logit bias, and stop
tokens banned until ``min_new_tokens`` tokens exist.
"""
import math
from collections.abc import Iterable


def processed_logits(logits: list[float], prompt: list[int], output: list[int], *, repetition_penalty: float = 1.0,
                     frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                     logit_bias: Iterable[tuple[int, float]] = (), min_new_tokens: int = 0,
                     stop_tokens: Iterable[int] = ()) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(output):
        out[token] = out[token] / repetition_penalty if out[token] > 0 else out[token] * repetition_penalty
    for token in set(output):
        out[token] -= output.count(token) * frequency_penalty + presence_penalty
    for token, bias in logit_bias:
        out[token] += bias
    if len(output) < min_new_tokens:
        for token in stop_tokens:
            out[token] = -math.inf
    return out


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)
