"""``hypic.Engine``: load a checkpoint, cache segments, prefill in four modes, generate."""
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .assembler import Steps, combine_chunked, drain
from .decode import decode_batch
from .default_model import default_model_path
from .errors import InvalidRequest
from .cache.eviction import Eviction
from .grammar import Constraint, GrammarCompiler
from .loader import DTYPE_NAMES, load_model, model_fingerprint, read_quantization, resolve_dtype
from .quantization import Quantization
from .models import HybridModel
from .parallel import TensorParallel
from .parallel.group import common_seed
from .cache.modes import Mode, ModePolicy, tree_namespace
from .planner import Planner
from .prefill_stats import BuiltForRequest, PrefillStats, Reuse
from .resume_points import ResumePoints
from .cache.plan import RequestPlan
from .cache.prefix_cache import PrefixCache
from .sampling import SamplingParams
from .segment_prefill import prefill_interior_steps
from .tier_loads import TierLoads
from . import sizing
from .cache.segments import DEFAULT_SEPARATOR, PromptParts, Run, Seams, build_layout
from .sequence import Sequence, SequenceLimits
from .state import LinearLayerState, RequestState, WindowLayerState
from .cache.store import LinearInterior, Load, SegmentEntry, SegmentStore, entry_key
from .cache.tiers.entry_file import EntryIdentity
from .cache.tiers.options import TierOptions, build_tiers
from .cache.tiers.resume import ResumeStore
from .tokenizer import TextTokenizer

@dataclass
class Prefill:
    """A prefilled request: first-token logits [vocab] and the state decode continues from; with
    ``logits_from`` p, ``prompt_logits`` [len - p, vocab] holds the logits at positions p.. (the
    distribution of each next prompt token: input logprobs). ``reuse``: what the prefill found;
    ``built``: what was done for the request before it (set by whoever knows: ``for_request``)."""

    logits: torch.Tensor
    state: RequestState
    reuse: Reuse
    prompt_logits: torch.Tensor | None = None
    built: BuiltForRequest = BuiltForRequest()

    @property
    def stats(self) -> PrefillStats:
        """What the request reused and recomputed, counted as its client experienced it."""
        return self.reuse.stats(self.built)

    def for_request(self, built: BuiltForRequest) -> "Prefill":
        """This prefill, counted for a request for which ``built`` was done beforehand."""
        return replace(self, built=built)


@dataclass
class GenerationResult:
    """Output of ``Engine.generate``."""

    output_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    ttft_s: float
    e2e_s: float
    finish_reason: str
    mode: Mode
    segments_hit: int = 0
    segments_missed: int = 0
    stats: PrefillStats = field(default_factory=PrefillStats, repr=False)


class Engine:
    """A hybrid model with a public pool (segments) and a private pool (prefix cache of request states).
    Not thread-safe: the server drives it from one engine-loop thread."""

    def __init__(self, model: HybridModel, tokenizer: TextTokenizer, fingerprint: str, *,
                 seam_width: int = 8, pic_separator: str = DEFAULT_SEPARATOR, store: SegmentStore | None = None,
                 prefix_cache: PrefixCache | None = None, chunk_tokens: int = 2048,
                 snapshot_interval: int | None = None, state_cache_dtype: str = "float32",
                 resume: ResumeStore | None = None, quantization: Quantization | None = None) -> None:
        if snapshot_interval is None:
            snapshot_interval = sizing.default_snapshot_interval(model.config)
        if not isinstance(seam_width, int) or seam_width < 0:
            raise InvalidRequest(f"seam_width must be an integer >= 0, got {seam_width!r}")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise InvalidRequest(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")
        if not isinstance(snapshot_interval, int) or snapshot_interval < 0:
            raise InvalidRequest(f"snapshot_interval must be an integer >= 0 (0: off), got {snapshot_interval!r}")
        self.chunk_tokens = chunk_tokens  # prefill work between two decode steps of a serving loop
        self.snapshot_interval = snapshot_interval  # private-pool snapshots every this many prompt tokens
        if state_cache_dtype not in DTYPE_NAMES:
            raise InvalidRequest(f"state_cache_dtype must be one of {sorted(DTYPE_NAMES)}, got {state_cache_dtype!r}")
        self.state_cache_dtype = DTYPE_NAMES[state_cache_dtype]  # T_C and S_C|0 in the public pool
        if not pic_separator:
            raise InvalidRequest("pic_separator must be a non-empty string")
        self.model, self.tokenizer, self.fingerprint = model, tokenizer, fingerprint
        self.quantization = quantization  # how the checkpoint stored its weights (held dequantized in model.dtype)
        self.seam_width, self.pic_separator = seam_width, pic_separator
        config = model.config
        self.planner = Planner(tokenizer, fingerprint, seam_width, config.linear_conv_kernel_dim,
                               config.max_position_embeddings, config.vocab_size, pic_separator)
        self.store = store if store is not None else SegmentStore()
        parameters = sizing.parameter_count(model)  # the public pool weighs each entry by its rebuild cost
        self.store.rebuild_cost = lambda entry: sizing.rebuild_flops(config, parameters, len(entry.token_ids))
        self.prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.resume = resume  # the private pool's resume points on disk and in Mooncake (None: memory only)
        self.resume_points = ResumePoints(model, self.prefix_cache, resume, snapshot_interval)
        self.tier_loads = TierLoads(self.store, self.resume_points, self.entry_bytes)
        self.eos_token_ids = set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids())
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, sorted(self.eos_token_ids))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "cpu", dtype: str = "auto", seam_width: int = 8,
                        pic_separator: str = DEFAULT_SEPARATOR, public_pool_bytes: int | None = None,
                        private_pool_bytes: int | None = None, private_window_bytes: int | None = None,
                        chunk_tokens: int = 2048, snapshot_interval: int | None = None,
                        state_cache_dtype: str = "float32", tiers: TierOptions = TierOptions(),
                        eviction: Eviction = Eviction.LRU, tp: TensorParallel = TensorParallel(),
                        tp_size: int = 1) -> "Engine":
        """Load a local HF-format checkpoint directory (config.json, *.safetensors, tokenizer.json).
        ``"default"`` loads the model shipped in the package (``hypic.default_model_path()``).
        ``dtype``: float32, bfloat16, float16, or auto (the checkpoint's; float32 on a CPU that does
        not multiply half precision natively). Pool budgets in bytes; None means unbounded
        (``private_window_bytes``: the sliding-window tails within the private pool). ``tiers``: the
        public pool's disk and Mooncake tiers (none by default); ``eviction``: the public pool's order
        (``hypic.cache.eviction``). ``tp``: this process is one rank of a tensor-parallel group and
        holds that rank's share of the model and of every cache (``hypic.parallel``). ``tp_size`` N > 1:
        this process becomes rank 0 of N, the others are started here, and an
        ``hypic.parallel.engine_group.EngineGroup`` is returned, whose ``generate``, ``prefill``,
        ``warmup`` and ``flush`` run on every rank."""
        if tp_size != 1:
            from .parallel.engine_group import EngineGroup
            return EngineGroup(path, tp_size, device=device, dtype=dtype, seam_width=seam_width,  # type: ignore[return-value]
                               pic_separator=pic_separator, public_pool_bytes=public_pool_bytes,
                               private_pool_bytes=private_pool_bytes, private_window_bytes=private_window_bytes,
                               chunk_tokens=chunk_tokens, snapshot_interval=snapshot_interval,
                               state_cache_dtype=state_cache_dtype, tiers=tiers, eviction=eviction)
        if dtype not in (*DTYPE_NAMES, "auto"):
            raise InvalidRequest(f"dtype must be auto or one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
        path = default_model_path() if str(path) == "default" else Path(path)
        if not path.is_dir():
            raise InvalidRequest(f"model path {str(path)!r} is not a directory")
        model = load_model(path, device, resolve_dtype(dtype, path, device), tp)
        fingerprint = model_fingerprint(path)
        identity = EntryIdentity(fingerprint, model.dtype, DTYPE_NAMES.get(state_cache_dtype, torch.float32),
                                 model.config, model.device)
        built = build_tiers(tiers, identity)
        return cls(model, TextTokenizer.from_dir(path), fingerprint, seam_width=seam_width,
                   pic_separator=pic_separator, store=SegmentStore(public_pool_bytes, built.public, eviction, tp),
                   prefix_cache=PrefixCache(private_pool_bytes, private_window_bytes), chunk_tokens=chunk_tokens,
                   snapshot_interval=snapshot_interval, state_cache_dtype=state_cache_dtype, resume=built.resume,
                   quantization=read_quantization(path))

    # ----- caching -------------------------------------------------------------------------
    def policy(self, mode: Mode | str, namespace: str = "") -> ModePolicy:
        """What ``mode`` reuses and how, for this engine's seam width and model, inside cache
        ``namespace`` ("": the shared one)."""
        return self.planner.policy(mode, namespace)

    @property
    def seams(self) -> Seams:
        """HYPIC's cut of a PIC segment: max(w, k - 1) head tokens, w tail tokens recomputed."""
        seams = self.policy("hypic").seams
        assert seams is not None
        return seams

    def segment_entry(self, token_ids: tuple[int, ...], policy: ModePolicy) -> tuple[SegmentEntry, bool]:
        """The cached interior of a segment (prefilled alone on a miss); returns (entry, was_hit)."""
        entry, key = self.lookup_segment(token_ids, policy)
        return (entry, True) if entry is not None else (drain(self.build_segment(key, token_ids, policy)), False)

    def lookup_segment(self, token_ids: tuple[int, ...], policy: ModePolicy,
                       peek: bool = False) -> tuple[SegmentEntry | None, str]:
        """The public-pool entry of a segment (or None) and its key; ``peek``: without counting a hit
        or a miss or touching the LRU order."""
        key = self.segment_key(token_ids, policy)
        return (self.store.peek(key, token_ids) if peek else self.store.get(key, token_ids, policy.namespace)), key

    def segment_key(self, token_ids: tuple[int, ...], policy: ModePolicy) -> str:
        """The public-pool key of a segment under ``policy`` (its content address in its namespace)."""
        assert policy.seams is not None
        return entry_key(self.fingerprint, policy.seams, policy.role, token_ids, policy.namespace)

    def build_segment(self, key: str, token_ids: tuple[int, ...], policy: ModePolicy) -> Steps[SegmentEntry]:
        """Prefill a segment alone (in chunks) and offer its interior to the public pool (kept only if it fits)."""
        assert policy.seams is not None
        layers = yield from prefill_interior_steps(self.model, token_ids, policy.seams, self.chunk_tokens,
                                                   policy.transitions)
        lo, hi = policy.seams.interior(len(token_ids)) or (0, 0)
        # under tensor parallelism each rank's shard has its own decayed heads, but the ranks' pools must
        # take the same bytes for an entry to decide alike: the shards keep every matrix
        flag = not self.model.config.tensor_parallel.enabled
        layers = [layer.stored_as(self.state_cache_dtype, flag) if isinstance(layer, LinearInterior) else layer
                  for layer in layers]
        entry = SegmentEntry(key, token_ids, policy.seams, lo, hi - lo, layers, policy.namespace)
        self.store.put(entry)
        return self.store.peek(key, token_ids) or entry  # the stored copy if it fits: one copy in memory

    def warmup(self, documents: list[str], mode: Mode | str = Mode.HYPIC, namespace: str = "") -> list[int]:
        """Cache each document as a PIC segment the way ``mode`` does (hypic or naive), in cache
        ``namespace``; returns each document's token count. Documents too short to have an interior
        are counted but not cached."""
        return drain(self.warmup_steps(documents, mode, namespace))

    def warmup_steps(self, documents: list[str], mode: Mode | str = Mode.HYPIC,
                     namespace: str = "") -> Steps[list[int]]:
        """``warmup`` one chunk of work per ``next()`` (what a serving loop interleaves with decode);
        the documents are checked, and bad ones refused, before it returns."""
        policy, encoded = self._warmup_plan(documents, mode, namespace)
        return self._warmup_run(policy, encoded)

    def build_steps(self, segments: list[tuple[int, ...]], mode: Mode | str = Mode.HYPIC,
                    namespace: str = "") -> Steps[list[int]]:
        """``warmup_steps`` for documents already split and tokenized (a router's share of a request)."""
        return self._warmup_run(self._caching_policy(mode, namespace), segments)

    def _caching_policy(self, mode: Mode | str, namespace: str = "") -> ModePolicy:
        """The policy of ``mode`` in ``namespace``, which must cache segments to warm anything up."""
        policy = self.policy(mode, namespace)
        if not policy.caches_segments:
            raise InvalidRequest(f"mode {mode!r} caches no segments, so there is nothing to warm up "
                                 "(warm-up needs mode 'hypic' or 'naive')")
        return policy

    def _warmup_run(self, policy: ModePolicy, encoded: list[tuple[int, ...]]) -> Steps[list[int]]:
        for ids in encoded:
            if policy.seams is not None and policy.seams.interior(len(ids)) is not None:
                entry, key = self.lookup_segment(ids, policy)
                if entry is None:
                    yield from self.build_segment(key, ids, policy)
        return [len(ids) for ids in encoded]

    def check_documents(self, documents: list[str]) -> None:
        """Documents to warm up: strings, none empty, none holding the PIC separator (a request would
        split such a document in two, so its entry could never be hit)."""
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise InvalidRequest("documents must be a list of strings")
        for index, document in enumerate(documents):
            if not document:
                raise InvalidRequest(f"document {index} is empty")
            if self.pic_separator in document:
                raise InvalidRequest(f"document {index} contains the PIC separator {self.pic_separator!r}: a request "
                                     "would split it into two segments; warm up each part as its own document")

    def _warmup_plan(self, documents: list[str], mode: Mode | str,
                     namespace: str) -> tuple[ModePolicy, list[tuple[int, ...]]]:
        policy = self._caching_policy(mode, namespace)
        self.check_documents(documents)
        encoded = [tuple(self.tokenizer.encode(d)) for d in documents]
        for index, ids in enumerate(encoded):
            if not ids:
                raise InvalidRequest(f"document {index} is empty")
        needed, budget = sum(self.entry_bytes(len(ids), mode) for ids in set(encoded)), self.store.budget_bytes
        if budget is not None and self.store.lower is None and needed > budget:  # they would evict each other
            raise InvalidRequest(f"the documents' cache entries take {needed} bytes, more than the public pool holds "
                                 f"({budget} bytes): warm up fewer at once, or raise --public-pool-size")
        return policy, encoded

    def entry_bytes(self, tokens: int, mode: Mode | str = Mode.HYPIC) -> int:
        """Bytes of the public-pool entry of a ``tokens``-token document under ``mode`` (``sizing.entry_bytes``)."""
        return sizing.entry_bytes(self.model.config, self.policy(mode), tokens, self.model.dtype, self.state_cache_dtype)

    def flush(self, namespace: str | None = None,
              tiers: frozenset[str] = frozenset({"memory"})) -> tuple[int, int, dict[str, int]]:
        """Empty the tiers named in ``tiers``: ``memory`` (both pools, and host memory below a GPU's),
        ``disk``, ``mooncake`` (documents and the private pool's resume points);
        ``namespace``: only that cache namespace's entries and trees. Returns (public entries,
        private-pool nodes, entries per lower tier) dropped. Entries in use stay."""
        public = private = 0
        if "memory" in tiers:
            trees = None if namespace is None else (lambda tree: tree_namespace(tree) == namespace)
            public, private = self.store.clear(namespace), self.prefix_cache.clear(trees)
        if self.resume is not None and tiers & {"disk", "mooncake"}:
            self.resume.drain()  # the resume points being written are flushed too
        dropped = self.store.lower.flush(set(tiers), namespace) if self.store.lower is not None else {}
        if self.resume is not None and "disk" in tiers:
            self.resume.forget(namespace)
        return public, private, dropped

    def close(self) -> None:
        """Hand memory's entries to the lower tiers' write policy and finish their writes (and the
        resume points' under way)."""
        self.store.close()
        if self.store.lower is not None:
            self.store.lower.close()
        self.resume_points.close()

    def state_bytes(self, tokens: int, samples: int = 1, shared_tokens: int = 0) -> int:
        """Memory a request's state takes (``sizing.state_bytes``: the server's admission budget)."""
        return sizing.state_bytes(self.model.config, self.model.dtype, tokens, samples, shared_tokens)

    def plan(self, parts: PromptParts, mode: Mode | str = Mode.HYPIC, logits_from: int | None = None) -> RequestPlan:
        """What a prefill of ``parts`` under ``mode`` reuses, worked out once (see ``RequestPlan``):
        the segments it splices (none from ``logits_from`` on), their public-pool keys, its layout
        marks and its private-pool key. Pure: safe on any thread."""
        return self.planner.plan(parts, mode, logits_from)

    def prefetch(self, plan: RequestPlan) -> list[Load]:
        """Start reading ``plan``'s documents and resume point from the lower tiers (``TierLoads.prefetch``)."""
        return self.tier_loads.prefetch(plan)

    def discard_prefetch(self, plan: RequestPlan) -> None:
        """Drop what ``prefetch`` read for ``plan``'s resume point (its request went away unserved)."""
        self.tier_loads.discard_prefetch(plan)

    def load_from_tiers(self, plan: RequestPlan) -> tuple[tuple[str, str], ...]:
        """Bring ``plan``'s documents that only a lower tier holds into memory now (``TierLoads.load_from_tiers``)."""
        return self.tier_loads.load_from_tiers(plan)

    def uncached_tokens(self, plan: RequestPlan) -> int:
        """About how many prompt tokens ``plan``'s prefill would compute now (``TierLoads.uncached_tokens``)."""
        return self.tier_loads.uncached_tokens(plan)

    # ----- prefill -------------------------------------------------------------------------
    def parse(self, prompt: str | list[int], namespace: str = "") -> PromptParts:
        """Split and tokenize a prompt, checking it fits the model's positions. A list of token ids
        is taken as it is (no segments: every token is Q, though a prefix-cache hit still applies).
        ``namespace``: the cache namespace the request lives in ("": shared). Pure: safe on any thread."""
        return self.planner.parse(prompt, namespace)

    def _segment_entries(self, plan: RequestPlan, indices: list[int], found: list[tuple[str, int, str | None]],
                         pinned: list[str]) -> Steps[dict[int, SegmentEntry]]:
        """The cached interior of each segment in ``indices``: a public-pool hit, or the segment
        prefilled alone (a ``CombineWork`` per chunk); each is recorded in ``found`` (key, tokens,
        tier it came from or None: built here). Each is pinned, and its key added to ``pinned``,
        before any yield: other requests' inserts must not evict it."""
        entries: dict[int, SegmentEntry] = {}
        policy = plan.policy
        for index in indices:
            segment, key = plan.parts.segments[index], plan.entry_keys[index]
            entry, tier = self.store.fetch(key, segment, policy.namespace)
            self.store.pin(key)
            pinned.append(key)
            if entry is None:
                entry, tier = (yield from self.build_segment(key, segment, policy)), None
            entries[index] = entry
            found.append((key, entry.length, tier))
        return entries

    def prefill_steps(self, plan: RequestPlan, snapshot_end: bool = False) -> Steps[Prefill]:
        """Prefill a planned request (``Engine.plan``) as ``Steps``: one ``CombineWork`` per chunk of at
        most ``chunk_tokens`` (of a cold segment's prefill or of the combine pass); returns the
        ``Prefill``, with the logits of every position from ``plan.logits_from`` on if it asks for
        them (computed exactly), and a record of what it reused (``Reuse``: whoever knows what was
        done for the request beforehand derives its counts from it). ``snapshot_end``: the private
        pool also keeps the state at the prompt's end (a head combined early: its request resumes
        there). Public entries the request uses stay pinned until its combine pass is done.
        Everything it reuses or keeps is in the plan's namespace."""
        parts, policy, ids = plan.parts, plan.policy, plan.parts.token_ids
        init, resumed = self.resume_points.resume_state(plan.tree_key, policy)
        after_resume = [i for i in plan.spliced if parts.segment_starts[i] >= init.length]
        pinned: list[str] = []
        found: list[tuple[str, int, str | None]] = []
        try:
            entries = yield from self._segment_entries(plan, after_resume, found, pinned)
            keep = policy.tree is not None and self.prefix_cache.budget_bytes != 0
            pieces = build_layout(parts, policy.seams, set(entries), init.length)
            snapshot_at = self.resume_points.snapshot_positions(parts, init.length, snapshot_end) if keep else []
            result = yield from combine_chunked(self.model, ids, pieces, init, entries, chunk_tokens=self.chunk_tokens,
                                                naive=not policy.transitions, snapshot_at=snapshot_at,
                                                logits_from=plan.logits_from)
        finally:
            for key in pinned:
                self.store.unpin(key)
        result.state.marks = plan.marks
        if policy.tree is not None:
            self.prefix_cache.insert(policy.tree, result.state, result.snapshots)
            if parts.leading and plan.spliced and len(parts.leading) in result.snapshots:  # a system prompt's end
                self.resume_points.keep(policy.tree, policy.namespace, result.state, len(parts.leading),
                                        result.snapshots[len(parts.leading)])
        assert result.logits is not None
        reuse = Reuse(len(ids), resumed, tuple(found), sum(p.length for p in pieces if isinstance(p, Run)))
        return Prefill(result.logits, result.state, reuse, result.row_logits)

    def prefill(self, parts: PromptParts, mode: Mode | str = Mode.HYPIC, logits_from: int | None = None,
                built: BuiltForRequest = BuiltForRequest()) -> Prefill:
        """Prefill a parsed request under ``mode`` (hypic | full | prefix | naive) in one go."""
        return drain(self.prefill_steps(self.plan(parts, mode, logits_from))).for_request(built)

    def held_head(self, plan: RequestPlan, arriving: frozenset[str] = frozenset()) -> RequestPlan | None:
        """The plan of ``plan``'s prompt cut after its longest run of leading documents whose spliced
        interiors the public pool holds (no query), when that run stops short of the last document
        and holds a spliced document past the request's private-pool resume point; else None
        (nothing to combine early). Documents keyed in ``arriving`` count as not held yet, even if
        they came in meanwhile: the head is what was held when it was asked for."""
        parts, policy = plan.parts, plan.policy
        if policy.seams is None or policy.tree is None or self.prefix_cache.budget_bytes == 0:
            return None
        held = 0
        while held < len(parts.segments) and self._holds(plan, held, arriving):
            held += 1
        if held == len(parts.segments) or not (parts.leading or held):
            return None
        head_plan = plan.head(held)
        resume = self.prefix_cache.peek(policy.tree, head_plan.tree_key, len(head_plan.tree_key) - 1)
        return head_plan if any(parts.segment_starts[i] >= resume for i in head_plan.spliced) else None

    def _holds(self, plan: RequestPlan, index: int, arriving: frozenset[str]) -> bool:
        """Whether segment ``index`` needs nothing more: not spliced, or its interior held, not arriving."""
        key = plan.entry_keys.get(index)
        return key is None or (key not in arriving and self.store.peek(key, plan.parts.segments[index]) is not None)

    def precombine(self, parts: PromptParts, mode: Mode | str = Mode.HYPIC,
                   built: BuiltForRequest = BuiltForRequest()) -> PrefillStats | None:
        """The combine pass over the held head of ``parts`` (``held_head``), its state kept in the
        private pool, so the whole request later resumes at that head's end (a combine node does this
        while its peers' last documents are still on their way). Returns the head's stats (None:
        nothing was run); pass them on in ``built.heads`` so the request's stats count the head as
        computed for it."""
        return drain(self.precombine_steps(self.plan(parts, mode), built))

    def precombine_steps(self, plan: RequestPlan, built: BuiltForRequest = BuiltForRequest(),
                         arriving: frozenset[str] = frozenset()) -> Steps[PrefillStats | None]:
        """``precombine`` of a planned request as ``Steps`` (the head is chosen at the first, documents
        keyed in ``arriving`` left out of it)."""
        head = self.held_head(plan, arriving)
        if head is None:
            return None
        prefill = yield from self.prefill_steps(head, snapshot_end=True)
        return prefill.reuse.stats(built)

    def remember(self, state: RequestState, mode: Mode | str, namespace: str = "") -> None:
        """Keep a finished request's state in the private pool of cache ``namespace`` (multi-turn
        reuse of its whole text)."""
        tree = self.policy(mode, namespace).tree
        if tree is None or state.length == 0:
            return
        linear = {i: layer for i, layer in enumerate(state.layers) if isinstance(layer, LinearLayerState)}
        self.prefix_cache.insert(tree, state, {state.length: linear})
        rings = {i: layer.fork() for i, layer in enumerate(state.layers) if isinstance(layer, WindowLayerState)}
        self.resume_points.keep(tree, self.policy(mode, namespace).namespace, state, state.length, {**linear, **rings})

    # ----- generation ----------------------------------------------------------------------
    def sequences(self, params: SamplingParams, prompt_ids: list[int], logprobs: int | None = None,
                  seed: int | None = None) -> list[Sequence]:
        """The ``params.n`` continuations of a prompt, checked against this model (prompt + max_new_tokens
        within its positions, token ids in its vocabulary, the grammar compiles). ``logprobs``: None,
        or record each token's logprob and its top-k alternatives. With a seed, sample i draws from ``seed + i``.
        ``seed``: the seed of an unseeded request (a tensor-parallel server's rank 0 draws one and hands it
        to the other ranks); None: torch's generator, or under tensor parallelism one rank 0 draws now."""
        params.check_context(len(prompt_ids), self.model.config.max_position_embeddings)
        vocab = self.model.config.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab] + [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        constraint = Constraint.of(params)
        if constraint is not None:
            self.grammars.compile(constraint)  # a bad grammar fails here, before any work
        limits = SequenceLimits(frozenset(self.eos_token_ids), self.model.config.max_position_embeddings, logprobs)
        tp = self.model.config.tensor_parallel
        if params.seed is not None:
            seed = params.seed
        elif seed is None and tp.enabled:
            seed = common_seed(tp)  # the ranks sample alike
        return [Sequence(params, list(prompt_ids), self.tokenizer, limits,
                         torch.Generator().manual_seed(seed + i) if seed is not None else None,
                         self.grammars.start(constraint) if constraint is not None else None,
                         seed=seed + i if seed is not None else None)
                for i in range(params.n)]

    def decode_step(self, state: RequestState, token: int) -> tuple[torch.Tensor, RequestState]:
        """Append one token to a request's state; returns its logits [vocab] and the new state."""
        logits, states = decode_batch(self.model, [state], [token])
        return logits[0], states[0]

    def generate(self, prompt: str | list[int], *, mode: Mode | str = Mode.HYPIC, built: BuiltForRequest = BuiltForRequest(),
                 namespace: str = "", **sampling: Any) -> GenerationResult:
        """Prefill ``prompt`` (separators mark PIC segments) under ``mode`` and decode one continuation.
        ``sampling``: any ``SamplingParams`` field (max_new_tokens=16, temperature=0, top_p, stop, ...);
        ``built``: what was computed for this request beforehand (see ``prefill_steps``); ``namespace``:
        the cache namespace it reuses from and caches into ("": shared)."""
        return drain(self.generate_steps(prompt, mode=mode, built=built, namespace=namespace, **sampling))

    def generate_steps(self, prompt: str | list[int], *, mode: Mode | str = Mode.HYPIC, built: BuiltForRequest = BuiltForRequest(),
                       namespace: str = "", **sampling: Any) -> Steps[GenerationResult]:
        """``generate`` as ``Steps``: the prefill asks for its combine passes (a worker's engine loop
        runs them among its other work); decoding runs at the end, in one go."""
        start = time.perf_counter()
        plan = self.plan(self.parse(prompt, namespace), mode)
        return (yield from self.generate_plan_steps(plan, built, start, **sampling))

    def generate_plan_steps(self, plan: RequestPlan, built: BuiltForRequest = BuiltForRequest(),
                            start: float | None = None, **sampling: Any) -> Steps[GenerationResult]:
        """``generate_steps`` of a request planned already (where it arrived: a router's); ``start``:
        when it arrived (``time.perf_counter``; now if None)."""
        params, mode = SamplingParams(**sampling), Mode.parse(plan.policy.name)
        if params.n != 1:
            raise InvalidRequest("Engine.generate makes one continuation (n = 1); the server runs n > 1")
        start = time.perf_counter() if start is None else start
        (sequence,) = self.sequences(params, plan.parts.token_ids)
        prefill = (yield from self.prefill_steps(plan)).for_request(built)
        logits, state, ttft = prefill.logits, prefill.state, time.perf_counter() - start
        state.reserve(state.length + params.max_new_tokens)
        while not sequence.finished:
            sequence.step(logits)
            if len(sequence.output_ids) == 1:
                ttft = time.perf_counter() - start
            if not sequence.finished:
                logits, state = self.decode_step(state, sequence.output_ids[-1])
        self.remember(state, mode, plan.parts.namespace)
        stats = prefill.stats
        return GenerationResult(sequence.output_ids, sequence.text, stats.prompt_tokens, stats.cached_tokens,
                                stats.recomputed_tokens, ttft, time.perf_counter() - start, sequence.finish_reason or "",
                                mode, stats.segments_hit, stats.segments_missed, stats)
