"""Request traces for the ``load`` study: a Prod-RAG-like stream of PIC prompts, or plain prompts
sharing long system prompts, with bursty arrivals.

``prod-rag`` (the paper's W5 in shape: heavy-tailed document popularity, bursty arrivals, a
configurable mean input length): every request is ``L SEP D1 SEP ... SEP Dk SEP Q``, its k
documents drawn without replacement from a pool by Zipf's law, so popular documents recur at
different positions behind different leading segments. Document lengths vary uniformly between
half and one and a half times ``mean_input_words / k``. ``shared-prefix``: plain prompts (no
separators), each one of ``groups`` long system prompts followed by its own question (SGLang's
"generated shared prefix" shape, where prefix caching must hit).

Arrivals are a gamma renewal process of rate 1 whose inter-arrival times have coefficient of
variation ``burstiness`` (1 is Poisson; above 1, bursts and lulls); a QPS level divides them by
the QPS, so every level replays the same requests, as the paper rescales its trace.
"""
import random
from dataclasses import dataclass

from hypic import DEFAULT_SEPARATOR

WORDS = ("river city company founder year product capital language mayor population museum bridge harbor "
         "market council festival library station garden tower valley forest island school hospital").split()
WORKLOADS = ("prod-rag", "shared-prefix")


class TraceError(ValueError):
    """Trace parameters that cannot make a trace."""


@dataclass(frozen=True)
class TraceConfig:
    """What a trace is made of; the same config and seed give the same trace."""

    workload: str = "prod-rag"
    documents: int = 40
    docs_per_request: int = 4
    mean_input_words: int = 960
    zipf: float = 1.1
    burstiness: float = 2.0
    groups: int = 4
    system_words: int = 300
    seed: int = 0

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise TraceError(f"unknown workload {self.workload!r}: one of {', '.join(WORKLOADS)}")
        if not 1 <= self.docs_per_request <= self.documents:
            raise TraceError("--docs-per-request must be between 1 and --documents")
        if self.mean_input_words < 2 * self.docs_per_request or self.system_words < 1 or self.groups < 1:
            raise TraceError("--mean-input-words must give each document at least 2 words; "
                             "--system-words and --groups must be >= 1")
        if self.zipf < 0 or self.burstiness <= 0:
            raise TraceError("--zipf must be >= 0 and --burstiness > 0")


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


class Trace:
    """A deterministic stream of prompts and their arrival times."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        rng = random.Random(config.seed)
        mean_doc = config.mean_input_words / config.docs_per_request
        self.documents = [f"Note {i}: " + random_words(rng, max(1, round(mean_doc * rng.uniform(0.5, 1.5)) - 2)) + "."
                          for i in range(config.documents)]
        self.systems = [f"System prompt {g}: " + random_words(rng, config.system_words) + "." for g in range(config.groups)]
        self.leading = [f"System prompt variant {v}: answer from the notes below." for v in range(4)]
        self.popularity = [1 / (rank + 1) ** config.zipf for rank in range(config.documents)]

    def prompts(self, count: int, offset: int, separator: str = DEFAULT_SEPARATOR) -> list[str]:
        """``count`` prompts; each ``offset`` is an independent slice of the stream."""
        rng = random.Random(self.config.seed * 1_000_003 + offset)
        if self.config.workload == "shared-prefix":
            return [self._shared_prefix_prompt(rng, f"{offset}-{index}") for index in range(count)]
        return [self._rag_prompt(rng, f"{offset}-{index}", separator) for index in range(count)]

    def _rag_prompt(self, rng: random.Random, name: str, separator: str) -> str:
        chosen: list[int] = []
        while len(chosen) < self.config.docs_per_request:
            pick = rng.choices(range(len(self.documents)), self.popularity)[0]
            if pick not in chosen:
                chosen.append(pick)
        question = f"\n\nQuestion {name}: which {rng.choice(WORDS)} is mentioned? Answer:"
        return separator.join([rng.choice(self.leading), *(self.documents[i] for i in chosen), question])

    def _shared_prefix_prompt(self, rng: random.Random, name: str) -> str:
        return (f"{rng.choice(self.systems)}\n\nQuestion {name}: which {rng.choice(WORDS)} and which "
                f"{rng.choice(WORDS)} are mentioned? Answer:")

    def arrivals(self, count: int, qps: float) -> list[float]:
        """Arrival times (s) of the first ``count`` requests at mean rate ``qps``: the first at 0."""
        if qps <= 0:
            raise TraceError(f"QPS must be > 0, got {qps}")
        cv = self.config.burstiness
        rng, times, now = random.Random(self.config.seed + 7919), [], 0.0
        for _ in range(count):
            times.append(now / qps)
            now += rng.gammavariate(1 / cv**2, cv**2)  # mean 1, standard deviation cv
        return times
