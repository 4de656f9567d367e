"""What a request's sampling parameters do to the model's logits before a token is picked.

Order (as vLLM and SGLang apply them): repetition penalty, frequency and presence penalties,
logit bias, the min_new_tokens ban on stop tokens, then the grammar's allowed-token mask.
Logprobs reported to clients are the model's own (raw) distribution, not these.
"""
from collections import Counter

import torch

from .params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """Repetition penalty over every token seen (prompt and output): positive logits divided by it,
    negative ones multiplied; then ``- count x frequency - (count > 0) x presence`` over the output."""
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = Counter(output_ids)
        tokens = torch.tensor(list(counts), dtype=torch.long, device=logits.device)
        times = torch.tensor(list(counts.values()), dtype=logits.dtype, device=logits.device)
        logits[tokens] -= times * params.frequency_penalty + params.presence_penalty
    return logits


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    for token, bias in params.logit_bias:
        logits[token] += bias
    return logits


def ban_tokens(logits: torch.Tensor, tokens: set[int]) -> torch.Tensor:
    """No chance for ``tokens`` (e.g. stop tokens before min_new_tokens)."""
    if tokens:
        logits[torch.tensor(sorted(tokens), dtype=torch.long, device=logits.device)] = float("-inf")
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   stop_tokens: set[int], allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The logits [vocab] (fp32, a new tensor) a token is sampled from. ``stop_tokens``: ids that end
    the request (banned until min_new_tokens); ``allowed``: bool mask [vocab] of a grammar, or None."""
    logits = logits.float().clone()
    if params.penalized:
        logits = apply_penalties(logits, params, prompt_ids, output_ids)
    logits = apply_logit_bias(logits, params)
    if len(output_ids) < params.min_new_tokens:
        logits = ban_tokens(logits, stop_tokens)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits
