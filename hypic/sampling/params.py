"""Sampling parameters (validated) and next-token selection."""
import math
from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequest, as_written

MAX_SAMPLES = 64  # n: continuations of one prompt sharing its prefill
GREEDY_BELOW = 1e-5  # temperatures under this are greedy, as in vLLM and SGLang


@dataclass(frozen=True)
class SamplingParams:
    """Decoding controls of one request (SGLang's and OpenAI's semantics); a temperature under
    ``GREEDY_BELOW`` (0 included) is greedy. Ranges are checked on construction and raise ``InvalidRequest`` naming the field."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    min_new_tokens: int = 0  # stop tokens and stop strings are suppressed until this many were generated
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's
    frequency_penalty: float = 0.0  # minus count x this, over generated tokens (OpenAI)
    presence_penalty: float = 0.0  # minus this for every token generated at least once (OpenAI)
    repetition_penalty: float = 1.0  # prompt and generated tokens: positive logits / p, negative x p (CTRL)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    stop: tuple[str, ...] = ()  # stop strings
    no_stop_trim: bool = False  # keep the matched stop string / stop token in the output text
    n: int = 1  # independent continuations sharing one prefill
    regex: str | None = None  # structured output: at most one of regex, json_schema, ebnf
    json_schema: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        for ok, name, message in self._checks():
            if not ok:
                raise InvalidRequest(message, param=name)

    def _checks(self) -> list[tuple[bool, str, str]]:
        """(passes, the field it checks, what is wrong) for every range check."""
        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        grammars = [name for name in ("regex", "json_schema", "ebnf") if getattr(self, name) is not None]
        return [
            (integer(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens",
             f"max_new_tokens must be an integer >= 0, got {as_written(self.max_new_tokens)}"),
            (integer(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens",
             f"min_new_tokens must be an integer in [0, max_new_tokens = {self.max_new_tokens}], got {as_written(self.min_new_tokens)}"),
            (number(self.temperature) and 0 <= self.temperature < math.inf, "temperature",
             f"temperature must be a finite number >= 0, got {as_written(self.temperature)}"),
            (number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {as_written(self.top_p)}"),
            (integer(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
             f"top_k must be -1 (off) or >= 1, got {as_written(self.top_k)}"),
            (number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {as_written(self.min_p)}"),
            (number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {as_written(self.frequency_penalty)}"),
            (number(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {as_written(self.presence_penalty)}"),
            (number(self.repetition_penalty) and 0 < self.repetition_penalty <= 2, "repetition_penalty",
             f"repetition_penalty must be in (0, 2], got {as_written(self.repetition_penalty)}"),
            (all(integer(t) and t >= 0 and number(b) and -100 <= b <= 100 for t, b in self.logit_bias), "logit_bias",
             "logit_bias maps token ids (>= 0) to biases in [-100, 100]"),
            (integer(self.n) and 1 <= self.n <= MAX_SAMPLES, "n", f"n must be an integer in [1, {MAX_SAMPLES}], got {as_written(self.n)}"),
            (len(grammars) <= 1, grammars[-1] if grammars else "regex",
             f"give at most one of regex, json_schema and ebnf, got {', '.join(grammars)}"),
            (self.seed is None or integer(self.seed), "seed", f"seed must be an integer, got {as_written(self.seed)}"),
        ]

    def check_context(self, prompt_tokens: int, context: int) -> None:
        """Prompt + max_new_tokens must fit the model's ``context`` positions (vLLM and SGLang refuse
        the request likewise, instead of cutting its output short)."""
        if prompt_tokens + self.max_new_tokens > context:
            raise InvalidRequest(f"the prompt has {prompt_tokens} tokens and max_new_tokens asks for "
                                 f"{self.max_new_tokens} more ({prompt_tokens + self.max_new_tokens} in all), over the "
                                 f"model's context of {context} tokens: ask for at most {max(context - prompt_tokens, 0)}",
                                 param="max_new_tokens")

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """Pick the next token from (processed) logits [vocab]."""
    if params.temperature < GREEDY_BELOW:  # dividing by a tinier one overflows the logits to inf, then NaN
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
