"""Sampling parameters (validated) and next-token selection."""
from dataclasses import dataclass, field

import torch

from .errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    """Decoding controls; ``temperature == 0`` is greedy."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
             and self.max_new_tokens >= 0, f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}"),
            (isinstance(self.temperature, (int, float)) and self.temperature >= 0,
             f"temperature must be a number >= 0, got {self.temperature!r}"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (off) or >= 1, got {self.top_k!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick the next token from logits [vocab]."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
