"""What the scheduler is handed and hands back: one validated prompt to generate from, and the
request's state as reported (its samples, what its prefill reused). The HTTP layer builds the one
and shapes the other; the loop runs between them."""
from dataclasses import dataclass, field, replace

from ..cache.modes import Mode
from ..errors import InvalidRequest
from ..prefill_stats import PrefillStats
from ..sampling import SamplingParams
from ..sequence import TokenLogprob


@dataclass(frozen=True)
class LogprobRequest:
    """The logprobs a request wants: each output token's and its ``top`` alternatives; input tokens'
    from prompt position ``start`` (-1: only the last prompt token, as SGLang's default)."""

    top: int = 0
    start: int = -1
    with_text: bool = False

    def input_from(self, prompt_length: int) -> int:
        """The first prompt position reported; raises if it is past the prompt."""
        start = prompt_length - 1 if self.start == -1 else self.start
        if not 0 <= start < prompt_length:
            raise InvalidRequest(f"logprob_start_len={self.start} is outside the prompt of {prompt_length} tokens")
        return start


@dataclass(frozen=True)
class GenerationRequest:
    """One validated prompt to generate from (a batch is several)."""

    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    logprobs: LogprobRequest | None = None
    echo: bool = False  # OpenAI completions: the prompt (and its logprobs) come back before the output
    rid: str | None = None
    to_context: bool = False  # max_new_tokens is the context the prompt leaves (set once it is tokenized)
    salt: tuple[str, ...] = ()  # the cache salt and extra key it named (its cache namespace with the caller's key)

    def fitted(self, prompt_tokens: int, context: int) -> "GenerationRequest":
        """This request, its output budget set to what the prompt leaves of the model's ``context``
        positions if it asked for no budget."""
        if not self.to_context:
            return self
        return replace(self, params=replace(self.params, max_new_tokens=max(context - prompt_tokens, 0)),
                       to_context=False)


@dataclass
class SampleResult:
    """One continuation as reported: its text so far (or final), ids, finish and logprobs."""

    text: str
    output_ids: list[int]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    matched_stop: int | str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Completion:
    """A request's state as reported: its samples and what its prefill reused."""

    rid: str
    samples: list[SampleResult]
    prompt_ids: list[int]
    prefill: PrefillStats  # what its prefill reused, wherever it ran (zeros until it is prefilled)
    ttft_s: float  # from the request's arrival at the server, like e2e_s
    e2e_s: float
    mode: Mode
    input_logprobs: list[TokenLogprob | None] | None = None  # from the requested start; None first

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)
