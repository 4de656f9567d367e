"""Counters of the engine loop, kept on its thread and published in its snapshot."""
from dataclasses import asdict, dataclass, field
from typing import Any

from ..prefill_stats import PrefillStats
from .requests import Completion

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


PREFILL_TOTALS = ("prompt_tokens", "cached_tokens", "recomputed_tokens", "segments_hit", "segments_missed",
                  "segments_built_remotely", "remote_prefill_tokens", "segments_fetched",
                  "replica_cached_tokens")  # exported as hypic_<name>_total


@dataclass
class LoopStats:
    """Totals since start; updated only on the loop thread."""

    requests_received: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_refused: int = 0  # queue full
    peer_prefill_failures: int = 0  # requests whose peer work broke (they ran here alone)
    loop_errors: dict[str, int] = field(default_factory=dict)  # failures of steps no request depends on, by step
    generated_tokens: int = 0
    prefill: PrefillStats = field(default_factory=PrefillStats)  # summed over prefilled requests
    ttft_sum_s: float = 0.0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    pass_tokens: int = 0  # prompt tokens the prefill passes computed (what a router's prefill rate is read from)
    pass_seconds: float = 0.0  # ... and the seconds those passes took
    decode_steps: int = 0  # batched decode steps (what a router's decode step time is read from)
    decode_seconds: float = 0.0  # ... and the seconds they took

    def add_pass(self, tokens: int, seconds: float) -> None:
        """A prefill step's passes: ``tokens`` computed in ``seconds``."""
        self.pass_tokens += tokens
        self.pass_seconds += seconds

    def add_decode_step(self, seconds: float) -> None:
        self.decode_steps += 1
        self.decode_seconds += seconds

    def add_prefill(self, stats: PrefillStats) -> None:
        self.prefill.add(stats)

    def add_finished(self, completion: Completion) -> None:
        self.requests_finished += 1
        self.ttft_sum_s += completion.ttft_s
        for index, bound in enumerate(TTFT_BUCKETS):
            self.ttft_buckets[index] += completion.ttft_s <= bound

    def as_dict(self) -> dict[str, Any]:
        """The counters, the prefill totals among them (``PREFILL_TOTALS``, flat)."""
        totals = {**asdict(self.prefill), "recomputed_tokens": self.prefill.recomputed_tokens}
        return {**{k: v for k, v in asdict(self).items() if k != "prefill"},
                **{name: totals[name] for name in PREFILL_TOTALS}}
