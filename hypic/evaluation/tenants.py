"""The multi-tenant RAG workload of ``hypic eval cluster``: T tenants, each with its own D documents.

Every request belongs to one tenant (drawn by Zipf's law over tenants, exponent ``tenant_zipf``; 0
is uniform) and is ``L SEP Di SEP Dj SEP ... SEP Q``: one of a few system lines that all tenants
share, k of its tenant's documents in a fresh random order (drawn by Zipf's law over the tenant's
documents, exponent ``document_zipf``; 0: uniform), and its own question. With ``churn`` p, a
request names, with probability p, one document its tenant never had before in place of one of
them (a knowledge base that grows). One tenant of many documents with Zipf popularity is a corpus
shared by every user (``shared_corpus``). Every document has
exactly ``doc_words`` words after its ``Tenant t document d:`` header, so its length is set (and on
the shipped model well above the seams). Arrivals are Poisson at the level's QPS; the same config
and seed give the same requests and arrival times at every QPS (the times divided by the QPS).
"""
import random
from dataclasses import dataclass

from hypic import DEFAULT_SEPARATOR

from .trace import WORDS, TraceError, random_words

SYSTEM_LINES = 4
CHURN_SLICE = 1_000_000  # a document churn adds is numbered docs_per_tenant + slice x this + its request's place


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
    document_zipf: float = 0.0  # popularity of a tenant's documents (0: uniform)
    churn: float = 0.0  # the share of requests that name a document new to their tenant

    def __post_init__(self) -> None:
        if self.tenants < 1 or self.doc_words < 1:
            raise TraceError("--tenants and --doc-words must be >= 1")
        if not 1 <= self.docs_per_request <= self.docs_per_tenant:
            raise TraceError("--docs-per-request must be between 1 and --docs-per-tenant")
        if self.tenant_zipf < 0 or self.document_zipf < 0:
            raise TraceError("--tenant-zipf and --document-zipf must be >= 0")
        if not 0 <= self.churn <= 1:
            raise TraceError("--churn must be in [0, 1]")


def shared_corpus(documents: int = 400, docs_per_request: int = 5, zipf: float = 1.0, doc_words: int = 160,
                  seed: int = 0, churn: float = 0.0) -> TenantConfig:
    """One knowledge base every user asks: a single tenant of ``documents`` documents, each request
    ``docs_per_request`` of them drawn by Zipf's law (exponent ``zipf``) in random order."""
    return TenantConfig(1, documents, docs_per_request, doc_words, seed=seed, document_zipf=zipf, churn=churn)


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
        self.document_weights = [1 / (rank + 1) ** config.document_zipf for rank in range(config.docs_per_tenant)]

    def all_documents(self) -> list[str]:
        """Every tenant's documents: the working set."""
        return [doc for docs in self.documents for doc in docs]

    def requests(self, count: int, offset: int, separator: str = DEFAULT_SEPARATOR) -> list[TenantRequest]:
        """``count`` requests; each ``offset`` is an independent slice of the stream."""
        rng = random.Random(self.config.seed * 1_000_003 + offset)
        return [self._request(rng, offset, index, separator) for index in range(count)]

    def _request(self, rng: random.Random, offset: int, index: int, separator: str) -> TenantRequest:
        tenant = rng.choices(range(self.config.tenants), self.weights)[0]
        chosen = self._chosen(rng)
        if self.config.churn and rng.random() < self.config.churn:  # new: numbered by its place in the stream
            chosen = (*chosen[:-1], self.config.docs_per_tenant + offset * CHURN_SLICE + index)
        question = f"\n\nQuestion {offset}-{index}: which {rng.choice(WORDS)} is mentioned? Answer:"
        parts = [rng.choice(self.system_lines), *(self.document(tenant, d) for d in chosen), question]
        salt = f"tenant-{tenant}" if self.config.tenant_namespaces else None
        return TenantRequest(tenant, chosen, separator.join(parts), salt)

    def _chosen(self, rng: random.Random) -> tuple[int, ...]:
        """A request's documents of its tenant, in prompt order: uniform, or by popularity."""
        if not self.config.document_zipf:
            return tuple(rng.sample(range(self.config.docs_per_tenant), self.config.docs_per_request))
        chosen: list[int] = []
        while len(chosen) < self.config.docs_per_request:
            drawn = rng.choices(range(self.config.docs_per_tenant), self.document_weights)[0]
            chosen += [] if drawn in chosen else [drawn]
        rng.shuffle(chosen)
        return tuple(chosen)

    def document(self, tenant: int, index: int) -> str:
        """Document ``index`` of ``tenant`` (one of its first ``docs_per_tenant``, or one churn added)."""
        if index < self.config.docs_per_tenant:
            return self.documents[tenant][index]
        rng = random.Random(f"{self.config.seed}/{tenant}/{index}")
        return f"Tenant {tenant} document {index}: " + random_words(rng, self.config.doc_words) + "."

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
