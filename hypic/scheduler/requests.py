"""What the scheduler is handed and hands back: what it reads of a validated request, and the
request's state as reported (its samples, what its prefill reused). The HTTP layer builds the one
and shapes the other; the loop runs between them."""
from dataclasses import dataclass, field
from typing import Protocol

from ..cache.modes import Mode
from ..prefill_stats import PrefillStats
from ..sampling.params import SamplingParams
from ..sampling.sequence import TokenLogprob


class LogprobWish(Protocol):
    """The logprobs a request wants (``hypic.server.protocol.LogprobRequest``)."""

    top: int

    def input_from(self, prompt_length: int) -> int: ...


class Request(Protocol):
    """What the loop reads of a validated request (``hypic.server.protocol.GenerationRequest``)."""

    params: SamplingParams
    stream: bool
    logprobs: LogprobWish | None
    rid: str | None


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
    replica: str | None = None  # which data-parallel replica served it (None: a single instance)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.samples)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)
