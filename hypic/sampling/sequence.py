"""One continuation of a prompt, token by token: logits processing, sampling, logprobs, stop
conditions and its text. ``Engine.generate`` and the server's engine loop both drive requests
through this one state machine.
"""
from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalDetokenizer
from .grammar import GrammarState
from .logits_processing import process_logits
from .params import SamplingParams, sample
from ..tokenizer import TextTokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the ``top`` most likely tokens there
    (id, logprob), most likely first (empty unless top logprobs were asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The model's (unprocessed) log-probability of ``token`` from logits [vocab]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top > 0 else None
    alternatives = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), alternatives)


@dataclass
class SequenceLimits:
    """What bounds a sequence besides its sampling parameters."""

    eos_token_ids: frozenset[int]
    max_length: int  # the model's positions: prompt + output never exceed it
    logprobs: int | None = None  # None: no logprobs; k >= 0: each token's logprob and its top k


@dataclass
class Sequence:
    """One generated continuation. ``step`` takes the logits after the last token and picks the
    next; once ``finish_reason`` is set ("stop", "length" or "abort") it takes no more."""

    params: SamplingParams
    prompt_ids: list[int]
    tokenizer: TextTokenizer
    limits: SequenceLimits
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    stop_text_at: int = -1  # where the matched stop string starts in the text
    seed: int | None = None  # what ``generator`` was seeded with (None: torch's global generator)

    def __post_init__(self) -> None:
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        if self.params.max_new_tokens == 0:
            self.finish_reason = "length"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_token_ids(self) -> set[int]:
        """Tokens that end this sequence (EOS unless ignored, and the request's stop tokens)."""
        return set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(self.limits.eos_token_ids))

    def step(self, logits: torch.Tensor) -> int:
        """Pick and append the next token from the model's logits [vocab]; updates the finish state."""
        assert not self.finished
        allowed = self.grammar.allowed() if self.grammar is not None else None
        processed = process_logits(logits, self.params, self.prompt_ids, self.output_ids, self.stop_token_ids, allowed)
        token = sample(processed, self.params, self.generator)
        if self.limits.logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.limits.logprobs))
        self.output_ids.append(token)
        if self.grammar is not None and token not in self.stop_token_ids:
            self.grammar.accept(token)
        assert self.detokenizer is not None
        new_text = self.detokenizer.add(token)
        if self.grammar is not None and self.grammar.finished:  # it took its end (EOS under ignore_eos): nothing may follow
            self.finish_reason, self.matched_stop = "stop", token
        else:
            self._check_finish(token, new_text)
        return token

    def _check_finish(self, token: int, new_text: str) -> None:
        produced = len(self.output_ids)
        if produced >= self.params.min_new_tokens:
            if token in self.stop_token_ids:
                self.finish_reason, self.matched_stop = "stop", token
                return
            if new_text and self._find_stop_string(len(new_text)):
                return
        if produced >= self.params.max_new_tokens or len(self.prompt_ids) + produced >= self.limits.max_length:
            self.finish_reason = "length"

    def _find_stop_string(self, new_chars: int) -> bool:
        """A stop string ending in the text the last token added: finish there."""
        assert self.detokenizer is not None
        text = self.detokenizer.text
        for stop in self.params.stop:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            at = text.find(stop, start)
            if at >= 0:
                self.finish_reason, self.matched_stop, self.stop_text_at = "stop", stop, at
                return True
        return False

    def abort(self) -> None:
        if not self.finished:
            self.finish_reason = "abort"

    @property
    def text(self) -> str:
        """The output text: without the stop token or stop string that ended it (unless
        ``no_stop_trim``), and while running only the part no stop string can still claim."""
        assert self.detokenizer is not None
        if not self.finished:
            hold = max((len(s) for s in self.params.stop), default=1) - 1
            text = self.detokenizer.text
            return text[: len(text) - hold] if hold else text
        if isinstance(self.matched_stop, str):
            keep = len(self.matched_stop) if self.params.no_stop_trim else 0
            return self.detokenizer.text[: self.stop_text_at + keep]
        trim = isinstance(self.matched_stop, int) and not self.params.no_stop_trim
        return self.tokenizer.decode(self.output_ids[:-1] if trim else self.output_ids)
