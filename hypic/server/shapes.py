"""Response bodies and stream chunks as SGLang's and OpenAI's clients parse them.

SGLang ``/generate``: ``{text, output_ids, meta_info}`` per sample, a list for a batch or n > 1
(prompt-major); a stream sends that object after every token, cumulative, with ``index`` for
batches. OpenAI: ``choices`` indexed ``prompt x n + sample``, deltas when streaming, usage in a
final ``choices: []`` chunk when ``stream_options.include_usage`` asks for it.
"""
import time
from dataclasses import dataclass, field
from typing import Any

from ..sampling.sequence import TokenLogprob
from ..tokenizer import TextTokenizer
from .protocol import Completion, GenerationRequest, LogprobRequest, OpenAIOptions, SampleResult


def _sglang_finish(sample: SampleResult) -> dict[str, Any] | None:
    if sample.finish_reason is None:
        return None
    if sample.finish_reason == "stop":
        return {"type": "stop", "matched": sample.matched_stop}
    if sample.finish_reason == "length":
        return {"type": "length", "length": len(sample.output_ids)}
    return {"type": "abort", "message": "the client disconnected"}


class Shaper:
    """Turns completions into the JSON of each API (needs the tokenizer for token texts)."""

    def __init__(self, tokenizer: TextTokenizer, model_name: str) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    # ----- SGLang ----------------------------------------------------------------------------
    def _entry(self, logprob: float | None, token: int, with_text: bool) -> list[Any]:
        return [logprob, token, self.token_text(token) if with_text else None]

    def _sglang_logprobs(self, c: Completion, sample: SampleResult, wanted: LogprobRequest) -> dict[str, Any]:
        inputs = c.input_logprobs or []
        ids = c.prompt_ids[len(c.prompt_ids) - len(inputs):]
        meta: dict[str, Any] = {
            "input_token_logprobs": [self._entry(lp.logprob if lp else None, t, wanted.with_text) for lp, t in zip(inputs, ids)],
            "output_token_logprobs": [self._entry(lp.logprob, lp.token, wanted.with_text) for lp in sample.logprobs],
        }
        if wanted.top:
            tops = lambda lp: [self._entry(v, t, wanted.with_text) for t, v in lp.top]  # noqa: E731
            meta["input_top_logprobs"] = [tops(lp) if lp else None for lp in inputs]
            meta["output_top_logprobs"] = [tops(lp) for lp in sample.logprobs]
        return meta

    def meta_info(self, c: Completion, index: int, request: GenerationRequest) -> dict[str, Any]:
        """SGLang's meta_info of sample ``index``, plus HYPIC's breakdown of what was reused and, when
        there are any, ``warnings`` about how the prompt was read."""
        sample = c.samples[index]
        stats = c.prefill
        meta: dict[str, Any] = {
            "id": c.rid if len(c.samples) == 1 else f"{c.rid}_{index}", "finish_reason": _sglang_finish(sample),
            "prompt_tokens": c.prompt_tokens, "completion_tokens": len(sample.output_ids),
            "cached_tokens": stats.cached_tokens, "ttft": c.ttft_s, "recomputed_tokens": stats.recomputed_tokens,
            "prefix_hit_tokens": stats.prefix_hit_tokens, "segments_hit": stats.segments_hit,
            "segments_missed": stats.segments_missed, "segments_built_remotely": stats.segments_built_remotely,
            "segments_fetched": stats.segments_fetched,
            "remote_prefill_tokens": stats.remote_prefill_tokens, "combined_early_tokens": stats.combined_early_tokens,
            "combine_tokens": stats.combine_tokens, "cached_tokens_by_tier": stats.cached_tokens_by_tier, "mode": c.mode}
        if sample.finish_reason is not None:
            meta["e2e_latency"] = c.e2e_s
        if c.replica is not None:
            meta["replica"] = c.replica
        if request.warnings:
            meta["warnings"] = list(request.warnings)
        if request.logprobs is not None:
            meta.update(self._sglang_logprobs(c, sample, request.logprobs))
        return meta

    def sglang_item(self, c: Completion, index: int, request: GenerationRequest) -> dict[str, Any]:
        sample = c.samples[index]
        return {"text": sample.text, "output_ids": sample.output_ids, "meta_info": self.meta_info(c, index, request)}

    def sglang_body(self, completions: list[Completion], requests: list[GenerationRequest], listed: bool) -> Any:
        items = [self.sglang_item(c, i, r) for c, r in zip(completions, requests) for i in range(len(c.samples))]
        return items if listed else items[0]

    # ----- OpenAI ----------------------------------------------------------------------------
    def usage(self, completions: list[Completion]) -> dict[str, Any]:
        prompt = sum(c.prompt_tokens for c in completions)
        generated = sum(c.completion_tokens for c in completions)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": sum(c.prefill.cached_tokens for c in completions),
                                          "cached_tokens_by_tier": _by_tier(completions)}}

    def _top_dict(self, lp: TokenLogprob, top: int) -> dict[str, float]:
        entries = {self.token_text(t): v for t, v in lp.top[:top]}
        entries.setdefault(self.token_text(lp.token), lp.logprob)  # the sampled token is always there
        return entries

    def completion_logprobs(self, entries: list[TokenLogprob | None], ids: list[int], top: int,
                            offset: int = 0) -> dict[str, Any]:
        """OpenAI completions' logprobs object; ``None`` entries (the first echoed prompt token) have no logprob."""
        tokens = [self.token_text(t) for t in ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [lp.logprob if lp else None for lp in entries],
                "top_logprobs": [self._top_dict(lp, top) if lp else None for lp in entries], "text_offset": offsets}

    def chat_logprobs(self, entries: list[TokenLogprob], top: int) -> dict[str, Any]:
        def item(token: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**item(lp.token, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top[:top]]}
                            for lp in entries]}

    def _echo(self, c: Completion, request: GenerationRequest) -> str:
        return request.prompt if isinstance(request.prompt, str) else self.tokenizer.decode(c.prompt_ids)

    def completion_choice(self, c: Completion, index: int, request: GenerationRequest, options: OpenAIOptions,
                          number: int) -> dict[str, Any]:
        sample = c.samples[index]
        text, logprobs = sample.text, None
        if request.echo:
            text = self._echo(c, request) + text
        if options.top_logprobs is not None:
            entries: list[TokenLogprob | None] = list(sample.logprobs)
            ids = [lp.token for lp in sample.logprobs]
            if request.echo:
                entries, ids = [*(c.input_logprobs or []), *entries], [*c.prompt_ids, *ids]
            logprobs = self.completion_logprobs(entries, ids, options.top_logprobs)
        return {"index": number, "text": text, "logprobs": logprobs, "finish_reason": openai_reason(sample)}

    def chat_choice(self, c: Completion, index: int, options: OpenAIOptions, number: int) -> dict[str, Any]:
        sample = c.samples[index]
        logprobs = self.chat_logprobs(sample.logprobs, options.top_logprobs) if options.top_logprobs is not None else None
        return {"index": number, "message": {"role": "assistant", "content": sample.text}, "logprobs": logprobs,
                "finish_reason": openai_reason(sample)}

    def openai_body(self, rid: str, completions: list[Completion], requests: list[GenerationRequest],
                    options: OpenAIOptions, chat: bool) -> dict[str, Any]:
        choices = []
        for c, request in zip(completions, requests):
            for index in range(len(c.samples)):
                number = len(choices)
                choices.append(self.chat_choice(c, index, options, number) if chat
                               else self.completion_choice(c, index, request, options, number))
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self.usage(completions)}


def openai_reason(sample: SampleResult) -> str | None:
    if sample.finish_reason is None:
        return None
    return "length" if sample.finish_reason == "length" else "stop"


@dataclass
class OpenAIStream:
    """Per-choice progress of an OpenAI stream: the text and logprobs already sent."""

    shaper: Shaper
    rid: str
    chat: bool
    options: OpenAIOptions
    samples_per_prompt: int
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_logprobs: dict[int, int] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choices: list[dict[str, Any]], so_far: Completion | None = None) -> dict[str, Any]:
        """A chunk; with ``include_usage`` its usage is null, or, with ``continuous_usage_stats`` as
        vLLM does, the usage of ``so_far`` (the prompt the choice belongs to, up to this token)."""
        chunk = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.shaper.model_name, "choices": choices}
        if not self.options.include_usage:
            return chunk
        continuous = self.options.continuous_usage and so_far is not None
        return {**chunk, "usage": self.shaper.usage([so_far]) if continuous else None}

    def progress(self, position: int, index: int, c: Completion) -> list[dict[str, Any]]:
        """The chunks for what sample ``index`` of prompt ``position`` produced since the last ones."""
        number = position * self.samples_per_prompt + index
        sample = c.samples[index]
        first = number not in self.sent_text
        delta = sample.text[self.sent_text.get(number, 0):]
        new_logprobs = sample.logprobs[self.sent_logprobs.get(number, 0):]
        self.sent_text[number], self.sent_logprobs[number] = len(sample.text), len(sample.logprobs)
        reason = openai_reason(sample)
        if not (first or delta or new_logprobs or reason):
            return []
        choice: dict[str, Any] = {"index": number, "finish_reason": reason}
        top = self.options.top_logprobs
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice["logprobs"] = self.shaper.chat_logprobs(new_logprobs, top) if top is not None else None
        else:
            ids = [lp.token for lp in new_logprobs]
            choice["text"] = delta
            choice["logprobs"] = self.shaper.completion_logprobs(list(new_logprobs), ids, top) if top is not None else None
        return [self._chunk([choice], c)]

    def tail(self, completions: list[Completion]) -> list[dict[str, Any]]:
        """The usage chunk, when asked for."""
        if not self.options.include_usage:
            return []
        return [{**self._chunk([]), "usage": self.shaper.usage(completions)}]


def _by_tier(completions: list[Completion]) -> dict[str, int]:
    """Reused prompt tokens by the tier they came from, summed over ``completions``."""
    totals: dict[str, int] = {}
    for c in completions:
        for tier, tokens in c.prefill.cached_tokens_by_tier.items():
            totals[tier] = totals.get(tier, 0) + tokens
    return totals
