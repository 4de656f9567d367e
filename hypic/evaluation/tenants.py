"""The multi-tenant RAG workload of ``hypic eval cluster``: T tenants, each with its own D documents.

Every request belongs to one tenant (drawn by Zipf's law over tenants, exponent ``tenant_zipf``; 0
is uniform) and is ``L SEP Di SEP Dj SEP ... SEP Q``: one of a few system lines that all tenants
share, k of its tenant's documents in a fresh random order, and its own question. Every document has
exactly ``doc_words`` words after its ``Tenant t document d:`` header, so its length is set (and on
the shipped model well above the seams). Arrivals are Poisson at the level's QPS; the same config
and seed give the same requests and arrival times at every QPS (the times divided by the QPS).
"""
import random
from dataclasses import dataclass

from hypic import DEFAULT_SEPARATOR

from .trace import WORDS, TraceError, random_words

SYSTEM_LINES = 4


@dataclass(frozen=True)
class TenantConfig:
    """What the workload is made of."""

    tenants: int = 8
    docs_per_tenant: int = 6
    docs_per_request: int = 3
    doc_words: int = 160
    tenant_zipf: float = 0.0
    seed: int = 0
    tenant_namespaces: bool = False  # each tenant's requests name a cache salt of their own

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.doc_words < 1:
            raise TraceError("--tenants and --doc-words must be >= 1")
        if not 1 <= self.docs_per_request <= self.docs_per_tenant:
            raise TraceError("--docs-per-request must be between 1 and --docs-per-tenant")
        if self.tenant_zipf < 0:
            raise TraceError("--tenant-zipf must be >= 0")


@dataclass(frozen=True)
class TenantRequest:
    """One request: its tenant, the indices of its documents (in prompt order) and its prompt."""

    tenant: int
    documents: tuple[int, ...]
    prompt: str
    salt: str | None = None  # its cache salt (its tenant's, when tenants have namespaces of their own)


class TenantWorkload:
    """The tenants' documents and a deterministic stream of their requests."""

    def __init__(self, config: TenantConfig) -> None:
        self.config = config
        rng = random.Random(config.seed)
        self.documents = [[f"Tenant {t} document {d}: " + random_words(rng, config.doc_words) + "."
                           for d in range(config.docs_per_tenant)] for t in range(config.tenants)]
        self.system_lines = [f"System line {v}: answer from the tenant's documents below." for v in range(SYSTEM_LINES)]
        self.weights = [1 / (rank + 1) ** config.tenant_zipf for rank in range(config.tenants)]

    def all_documents(self) -> list[str]:
        """Every tenant's documents: the working set."""
        return [doc for docs in self.documents for doc in docs]

    def requests(self, count: int, offset: int, separator: str = DEFAULT_SEPARATOR) -> list[TenantRequest]:
        """``count`` requests; each ``offset`` is an independent slice of the stream."""
        rng = random.Random(self.config.seed * 1_000_003 + offset)
        return [self._request(rng, f"{offset}-{index}", separator) for index in range(count)]

    def _request(self, rng: random.Random, name: str, separator: str) -> TenantRequest:
        tenant = rng.choices(range(self.config.tenants), self.weights)[0]
        chosen = tuple(rng.sample(range(self.config.docs_per_tenant), self.config.docs_per_request))
        question = f"\n\nQuestion {name}: which {rng.choice(WORDS)} is mentioned? Answer:"
        parts = [rng.choice(self.system_lines), *(self.documents[tenant][d] for d in chosen), question]
        salt = f"tenant-{tenant}" if self.config.tenant_namespaces else None
        return TenantRequest(tenant, chosen, separator.join(parts), salt)

    def covering_count(self, limit: int, offset: int = 0) -> int:
        """The fewest of slice ``offset``'s first requests that name every document between them (at
        most ``limit``): a warm-up that long leaves no document to its first use in the timed phase."""
        seen: set[tuple[int, int]] = set()
        everything = len(self.all_documents())
        for count, request in enumerate(self.requests(limit, offset), 1):
            seen.update((request.tenant, d) for d in request.documents)
            if len(seen) == everything:
                return count
        return limit

    def arrivals(self, count: int, qps: float) -> list[float]:
        """Poisson arrival times (s) of the first ``count`` requests at rate ``qps``: the first at 0."""
        if qps <= 0:
            raise TraceError(f"QPS must be > 0, got {qps}")
        rng, times, now = random.Random(self.config.seed + 7919), [], 0.0
        for _ in range(count):
            times.append(now / qps)
            now += rng.expovariate(1.0)
        return times
