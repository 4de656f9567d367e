"""Every cache a request reuses from, behind one interface: the public pool of documents' interiors
(``SegmentStore``) with its disk and Mooncake tiers, and the private pool of request states
(``PrefixCache``) with its resume points below memory (``ResumePoints``).

Each operation comes in the two flavours a hybrid request needs: a *document* (looked up by its
content address, anywhere in a prompt) and a *prefix* (the longest stored head of the prompt).
``match`` finds what is held (in memory or below it), ``insert`` keeps what a prefill made, ``pin``
and ``unpin`` keep a document in memory while a request reads it, ``flush`` evicts on request; the
pools evict on their own as their budgets fill. Reads below memory can be started as a request
arrives (``prefetch``) so its prefill need not wait for them.
"""
from collections.abc import Callable, Iterator
from typing import Any

from .modes import ModePolicy, tree_namespace
from .plan import RequestPlan
from .entry_check import check_prefix_state
from .prefix_cache import PrefixCache, resume_snapshot
from .resume_points import ResumePoints
from .store import HoldingsListener, Load, SegmentEntry, SegmentStore, entry_key

LENT_TIER = "replica"  # where a document lent to a request came from: another replica's pool
from ..state import LinearLayerState, RequestState, WindowLayerState


class HybridCache:
    """Both pools of one model (``fingerprint``) and their tiers. ``entry_bytes(tokens, mode)``: the
    bytes of a document's entry (what a read from below memory expects)."""

    def __init__(self, fingerprint: str, public: SegmentStore, private: PrefixCache, resume_points: ResumePoints,
                 entry_bytes: Callable[[int, str], int]) -> None:
        self.fingerprint, self.public, self.private = fingerprint, public, private
        self.resume_points, self.entry_bytes = resume_points, entry_bytes
        self.lent: dict[str, tuple[SegmentEntry, int]] = {}  # documents lent to requests: (entry, requests holding it)

    # ----- documents: the public pool and its tiers ---------------------------------------------
    def document_key(self, token_ids: tuple[int, ...], policy: ModePolicy) -> str:
        """The public-pool key of a document under ``policy`` (its content address in its namespace)."""
        assert policy.seams is not None
        return entry_key(self.fingerprint, policy.seams, policy.role, token_ids, policy.namespace)

    def lookup_document(self, token_ids: tuple[int, ...], policy: ModePolicy,
                        peek: bool = False) -> tuple[SegmentEntry | None, str]:
        """A document's entry in memory (or None) and its key; ``peek``: without counting a hit or a
        miss or touching the eviction order."""
        key = self.document_key(token_ids, policy)
        found = self.public.peek(key, token_ids) if peek else self.public.get(key, token_ids, policy.namespace)
        return found, key

    def match_document(self, key: str, token_ids: tuple[int, ...], namespace: str) -> tuple[SegmentEntry | None, str]:
        """A document's entry from memory, lent to a request here (``lend_document``: tier
        ``LENT_TIER``), or a tier below memory (brought into memory), and the tier it came from;
        pinned, found or not, until ``unpin``: its request's own inserts cannot evict it."""
        lent = self.lent.get(key)
        if lent is not None and lent[0].token_ids == token_ids and self.public.peek(key, token_ids) is None:
            self.public.pin(key)
            return lent[0], LENT_TIER
        found = self.public.fetch(key, token_ids, namespace)
        self.public.pin(key)
        return found

    def lend_document(self, entry: SegmentEntry) -> bool:
        """A copy of a document another pool holds (fetched from it, checked by the caller), for a
        request here: kept in memory only if it fits beside what is held (evicting nothing), else
        lent until ``return_documents``. True: kept."""
        if self.keep_copy(entry):
            return True
        held = self.lent.get(entry.key)
        self.lent[entry.key] = (entry, 1 + (held[1] if held is not None else 0))
        return False

    def keep_copy(self, entry: SegmentEntry) -> bool:
        """A copy of a document another pool holds (checked by the caller), kept in memory only if it
        fits beside what is held, evicting nothing. True: kept."""
        return self.public.put_in_room(entry)

    def return_documents(self, keys: list[str]) -> None:
        """The requests that were lent ``keys`` are done with them: each goes once none holds it."""
        for key in keys:
            held = self.lent.pop(key, None)
            if held is not None and held[1] > 1:
                self.lent[key] = (held[0], held[1] - 1)

    def unpin(self, keys: list[str]) -> None:
        """Let the documents ``match_document`` pinned be evicted again."""
        for key in keys:
            self.public.unpin(key)

    def insert_document(self, entry: SegmentEntry) -> SegmentEntry:
        """Offer a built document to the public pool (kept only if it fits); returns the pool's copy
        when kept (one copy in memory), else ``entry``."""
        self.public.put(entry)
        return self.public.peek(entry.key, entry.token_ids) or entry

    def install_document(self, entry: SegmentEntry) -> bool:
        """Store a document built elsewhere (a peer's shipment, checked by the caller) in the public
        pool; whether memory kept it."""
        return self.public.put(entry)

    def document_keys(self) -> frozenset[str]:
        """The keys of every document memory holds (what a router plans with and its index syncs on)."""
        return self.public.keys()

    def listen(self, listener: HoldingsListener) -> None:
        """Tell ``listener`` of every document entry stored in or dropped from memory and the tiers below."""
        self.public.listen(listener)

    def held_below(self) -> Iterator[tuple[str, str, str, int]]:
        """(key, namespace, tier, tokens) of each document the tiers below memory list at start (a
        restarted server's disk), read from the files' headers: slow for many files."""
        return self.public.lower.held() if self.public.lower is not None else iter(())

    def lower_tiers_of(self, key: str, namespace: str) -> list[str]:
        """The tiers below memory ("host", "disk", "mooncake") whose index holds document ``key``
        (no I/O: what a router credits a replica with)."""
        return self.public.lower.tiers_holding(key, namespace) if self.public.lower is not None else []

    def held_documents(self, keys: list[str]) -> list[SegmentEntry]:
        """The entries of ``keys`` memory holds, in that order (evicted ones left out), without
        counting or touching them (what is shipped to a peer)."""
        return self.public.held(keys)

    def holds_all(self, entry_bytes: int) -> bool:
        """Whether the public pool can hold documents' entries of ``entry_bytes`` in all at once;
        with a tier below memory it always can (what memory lets go of stays below)."""
        budget = self.public.budget_bytes
        return budget is None or self.public.lower is not None or entry_bytes <= budget

    def held_head(self, plan: RequestPlan, arriving: frozenset[str] = frozenset()) -> RequestPlan | None:
        """The plan of ``plan``'s prompt cut after its longest run of leading documents whose spliced
        interiors memory holds (no query), when that run stops short of the last document and holds
        a spliced document past the request's resume point; else None (nothing to combine early).
        Documents keyed in ``arriving`` count as not held yet, even if they came in meanwhile: the
        head is what was held when it was asked for."""
        parts, policy = plan.parts, plan.policy
        if policy.seams is None or policy.tree is None or self.private.budget_bytes == 0:
            return None
        held = 0
        while held < len(parts.segments) and self._holds(plan, held, arriving):
            held += 1
        if held == len(parts.segments) or not (parts.leading or held):
            return None
        head_plan = plan.head(held)
        resume = self.private.peek(policy.tree, head_plan.tree_key, len(head_plan.tree_key) - 1)
        return head_plan if any(parts.segment_starts[i] >= resume for i in head_plan.spliced) else None

    def _holds(self, plan: RequestPlan, index: int, arriving: frozenset[str]) -> bool:
        """Whether segment ``index`` needs nothing more: not spliced, or its interior held, not arriving."""
        key = plan.entry_keys.get(index)
        return key is None or (key not in arriving and self.public.peek(key, plan.parts.segments[index]) is not None)

    # ----- prefixes: the private pool and its resume points ---------------------------------------
    def match_prefix(self, plan: RequestPlan) -> tuple[RequestState, tuple[int, str] | None]:
        """The state ``plan``'s prefill starts from (the longest stored head of its prompt, never the
        whole prompt) and where it came from (tokens and tier; None: from scratch)."""
        return self.resume_points.resume_state(plan.tree_key, plan.policy)

    def keeps_prefixes(self, policy: ModePolicy) -> bool:
        """Whether ``policy``'s prefills leave states in the private pool."""
        return policy.tree is not None and self.private.budget_bytes != 0

    def snapshot_positions(self, plan: RequestPlan, start: int, end: bool = False) -> list[int]:
        """Where ``plan``'s prefill (resumed at ``start``) keeps states (``ResumePoints.snapshot_positions``)."""
        keeps = self.keeps_prefixes(plan.policy)
        return self.resume_points.snapshot_positions(plan.parts, start, end) if keeps else []

    def insert_prefix(self, plan: RequestPlan, state: RequestState, snapshots: dict[int, dict[int, Any]]) -> None:
        """Keep a prefill's states (its end and the ``snapshots`` it took) in the private pool, and a
        system prompt's end as a resume point below memory."""
        policy, parts = plan.policy, plan.parts
        if policy.tree is None:
            return
        self.private.insert(policy.tree, state, snapshots)
        if parts.leading and plan.spliced and len(parts.leading) in snapshots:
            self.resume_points.keep(policy.tree, policy.namespace, state, len(parts.leading),
                                    snapshots[len(parts.leading)])

    def insert_finished(self, state: RequestState, policy: ModePolicy) -> None:
        """Keep a finished request's state (its whole text: multi-turn reuse) in the private pool."""
        if policy.tree is None or state.length == 0:
            return
        linear = {i: layer for i, layer in enumerate(state.layers) if isinstance(layer, LinearLayerState)}
        self.private.insert(policy.tree, state, {state.length: linear})
        rings = {i: layer.fork() for i, layer in enumerate(state.layers) if isinstance(layer, WindowLayerState)}
        self.resume_points.keep(policy.tree, policy.namespace, state, state.length, {**linear, **rings})

    def lend_prefix(self, plan: RequestPlan) -> RequestState | None:
        """A copy of the longest head of ``plan``'s prompt this private pool holds in memory (never the
        whole prompt), to send to another replica; None: none held, or its mode keeps no states."""
        if not self.keeps_prefixes(plan.policy):
            return None
        key = plan.tree_key
        return self.private.copy_at(plan.policy.tree, key, len(key) - 1,  # type: ignore[arg-type]
                                    self.resume_points.empty_state())

    def install_prefix(self, plan: RequestPlan, state: RequestState) -> int:
        """Keep ``state``, a head of ``plan``'s prompt that another replica sent (``lend_prefix``), in
        the private pool, where ``plan``'s prefill then resumes from it; returns its tokens (0: this
        pool keeps no states for ``plan``). A state that is not such a head, or not of this model's
        shapes, is refused (``EntryMismatch``) before anything is stored."""
        if not self.keeps_prefixes(plan.policy):
            return 0
        check_prefix_state(state, plan.tree_key, self.resume_points.empty_state())
        self.private.insert(plan.policy.tree, state, {state.length: resume_snapshot(state)})  # type: ignore[arg-type]
        return state.length

    # ----- reads below memory ---------------------------------------------------------------------
    def _not_in_memory(self, plan: RequestPlan) -> list[tuple[str, tuple[int, ...]]]:
        """(key, token ids) of each document ``plan`` splices that memory lacks, when there are lower
        tiers to look in (else none)."""
        if self.public.lower is None:
            return []
        return [(key, ids) for _, key, ids in plan.documents() if self.public.peek(key, ids) is None]

    def prefetch(self, plan: RequestPlan) -> list[Load]:
        """Start reading, from the tiers below memory, the documents ``plan`` splices that memory
        lacks and a resume point longer than memory's (a serving loop calls this as the request
        arrives); returns those reads, each with until when its request is held back for it."""
        loads = [self.public.lower.prefetch(key, ids, plan.policy.namespace,  # type: ignore[union-attr]
                                            self.entry_bytes(len(ids), plan.policy.name))
                 for key, ids in self._not_in_memory(plan)]
        loads.append(self.resume_points.prefetch(plan))
        return [load for load in loads if load is not None]

    def discard_prefetch(self, plan: RequestPlan) -> None:
        """Drop what ``prefetch`` read for ``plan``'s resume point (its request went away unserved)."""
        self.resume_points.discard_prefetch(plan)

    def load_from_tiers(self, plan: RequestPlan) -> tuple[tuple[str, str], ...]:
        """Bring the documents ``plan`` splices that only a lower tier holds into memory now (a router
        plans with what memory holds); returns (key, tier) of each loaded."""
        found = [(key, self.public.fetch(key, ids, plan.policy.namespace)) for key, ids in self._not_in_memory(plan)]
        return tuple((key, tier) for key, (entry, tier) in found if entry is not None)

    def uncached_tokens(self, plan: RequestPlan) -> int:
        """About how many prompt tokens ``plan``'s prefill would compute now: the prompt less its
        cached interiors (in memory, or in a lower tier's local index: the disk's) and its
        private-pool prefix (the scheduler's size of a request)."""
        total, cached, lower = len(plan.parts.token_ids), 0, self.public.lower
        for index, key, ids in plan.documents():
            entry = self.public.peek(key, ids)
            if entry is not None:
                cached += entry.length
            elif lower is not None and lower.indexed(key, plan.policy.namespace):
                cached += plan.interior_tokens(index)
        if plan.policy.tree is not None:
            cached += self.private.peek(plan.policy.tree, plan.tree_key, total - 1)
        return max(1, total - cached)

    # ----- eviction on request, and the end ---------------------------------------------------------
    def flush(self, namespace: str | None = None,
              tiers: frozenset[str] = frozenset({"memory"})) -> tuple[int, int, dict[str, int]]:
        """Empty the tiers named in ``tiers``: ``memory`` (both pools, and host memory below a GPU's),
        ``disk``, ``mooncake`` (documents and resume points); ``namespace``: only that cache
        namespace's. Returns (public entries, private-pool nodes, entries per lower tier) dropped.
        Entries in use stay."""
        public, private = self.flush_memory(namespace) if "memory" in tiers else (0, 0)
        return public, private, self.flush_below(namespace, tiers)

    def flush_memory(self, namespace: str | None = None) -> tuple[int, int]:
        """Empty both pools (of ``namespace`` only, if given); returns (public entries, private-pool
        nodes) dropped. Quick: what the engine loop runs between its steps."""
        trees = None if namespace is None else (lambda tree: tree_namespace(tree) == namespace)
        return self.public.clear(namespace), self.private.clear(trees)

    def flush_below(self, namespace: str | None, tiers: frozenset[str]) -> dict[str, int]:
        """Empty the tiers below memory named in ``tiers`` (host memory, disk, Mooncake); returns the
        entries each dropped. It waits for the writes under way: safe on a thread of its own while
        the pools serve, as long as nothing is admitted into ``namespace`` meanwhile."""
        resume = self.resume_points.store
        if resume is not None and tiers & {"disk", "mooncake"}:
            resume.drain()  # the resume points being written are flushed too
        dropped = self.public.lower.flush(set(tiers), namespace) if self.public.lower is not None else {}
        if resume is not None and "disk" in tiers:
            resume.forget(namespace)
        return dropped

    def tiers_ready(self) -> bool:
        """Whether every tier below memory answers now (Mooncake connects in the background after a
        start); True with none."""
        return self.public.lower is None or self.public.lower.ready()

    def drain(self) -> None:
        """Wait for the writes under way to the tiers below memory, documents' and resume points'
        (what was written is then there for the next read)."""
        if self.public.lower is not None:
            self.public.lower.drain()
        if self.resume_points.store is not None:
            self.resume_points.store.drain()

    def describe_tiers(self) -> dict[str, Any] | None:
        """The tiers below memory of the public pool, each one's state, and their policies (None: none)."""
        return self.public.lower.describe() if self.public.lower is not None else None

    def public_fill(self) -> float:
        """How full the public pool is: its bytes over its budget (0 when it has none)."""
        budget = self.public.budget_bytes
        return self.public.nbytes / budget if budget else 0.0

    def describe(self) -> dict[str, Any]:
        """Both pools' numbers and their tiers' (what ``/metrics`` and ``/get_server_info`` report)."""
        public, private, resume = self.public, self.private, self.resume_points.store
        return {
            "public_pool": {"bytes": public.nbytes, "budget_bytes": public.budget_bytes, "entries": len(public),
                            "hits": public.hits, "misses": public.misses, "evictions": public.evictions,
                            "rejected": public.rejected, "pinned": public.pinned,
                            "arena_reserved_bytes": public.arenas.reserved_bytes},
            "private_pool": {"bytes": private.nbytes, "budget_bytes": private.budget_bytes, "hits": private.hits,
                             "misses": private.misses, "evictions": private.evictions,
                             "window_bytes": private.window_nbytes, "window_budget_bytes": private.window_budget_bytes,
                             "window_evictions": private.window_evictions,
                             "snapshot_evictions": private.snapshot_evictions, "pages": private.arenas.used_slots,
                             "page_tokens": private.arenas.page_tokens,
                             "arena_reserved_bytes": private.reserved_bytes},
            "tiers": self.describe_tiers(),
            "resume_points": resume.describe() if resume is not None else None,
        }

    def close(self) -> None:
        """Hand memory's entries to the lower tiers' write policy and finish their writes (and the
        resume points' under way)."""
        self.public.close()
        if self.public.lower is not None:
            self.public.lower.close()
        self.resume_points.close()

