"""``hypic.Engine``: the Python API over one model. It loads a checkpoint and holds what a request
goes through: the planner (what a prompt reuses), the caches (``HybridCache``: both pools and
their tiers), the model runner (the passes) and the prefiller (a request's path through them);
it warms up documents, prefills in four modes and generates. The serving loop drives the same
parts one step at a time."""
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from .assembler import Steps, drain
from .loading.default_model import default_model_path
from .errors import InvalidRequest, as_written
from .cache.eviction import Eviction
from .sampling.grammar import GrammarCompiler
from .loading.loader import DTYPE_NAMES, load_model, model_fingerprint, read_quantization, resolve_dtype
from .loading.quantization import Quantization
from .models import HybridModel
from .models.families import linear_shapes
from .parallel import TensorParallel
from .cache.modes import Mode, ModePolicy
from .model_runner import ModelRunner
from .planner import Planner
from .prefill import Prefill, Prefiller
from .prefill_stats import BuiltForRequest, PrefillStats
from .cache.hybrid_cache import HybridCache
from .cache.resume_points import ResumePoints
from .cache.plan import RequestPlan
from .cache.prefix_cache import PrefixCache
from .sampling.params import SamplingParams
from . import sizing
from .cache.segments import DEFAULT_SEPARATOR, PromptParts
from .state import RequestState
from .cache.store import SegmentEntry, SegmentStore
from .cache.tiers.entry_file import EntryIdentity
from .cache.tiers.options import TierOptions, build_tiers
from .cache.tiers.resume import ResumeStore
from .intake import RequestIntake
from .tokenizer import TextTokenizer

StartGroup = Callable[..., Any]  # (path, tp_size, threads=..., mode=..., **options) -> a tensor-parallel group's rank 0
_start_group: list[StartGroup] = []


def serve_groups_with(start: StartGroup) -> None:
    """How ``Engine.from_pretrained(..., tp_size=N)`` starts a group: the package registers
    ``hypic.scheduler.engine_group.EngineGroup`` here when imported, since the engine sits below the scheduler."""
    _start_group[:] = [start]

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


class Engine(RequestIntake):
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
            raise InvalidRequest(f"seam_width must be an integer >= 0, got {as_written(seam_width)}")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise InvalidRequest(f"chunk_tokens must be an integer >= 1, got {as_written(chunk_tokens)}")
        if not isinstance(snapshot_interval, int) or snapshot_interval < 0:
            raise InvalidRequest(f"snapshot_interval must be an integer >= 0 (0: off), "
                                 f"got {as_written(snapshot_interval)}")
        self.chunk_tokens = chunk_tokens  # prefill work between two decode steps of a serving loop
        self.snapshot_interval = snapshot_interval  # private-pool snapshots every this many prompt tokens
        if state_cache_dtype not in DTYPE_NAMES:
            raise InvalidRequest(f"state_cache_dtype must be one of {', '.join(sorted(DTYPE_NAMES))}, "
                                 f"got {as_written(state_cache_dtype)}")
        self.state_cache_dtype = DTYPE_NAMES[state_cache_dtype]  # T_C and S_C|0 in the public pool
        if not pic_separator:
            raise InvalidRequest("pic_separator must be a non-empty string")
        self.model, self.tokenizer, self.fingerprint = model, tokenizer, fingerprint
        self.quantization = quantization  # how the checkpoint stored its weights (held dequantized in model.dtype)
        self.seam_width, self.pic_separator = seam_width, pic_separator
        config = model.config
        self.planner = Planner(tokenizer, fingerprint, seam_width, config.linear_conv_kernel_dim,
                               config.max_position_embeddings, config.vocab_size, pic_separator)
        store = store if store is not None else SegmentStore()
        parameters = sizing.parameter_count(model)  # the public pool weighs each entry by its rebuild cost
        store.rebuild_cost = lambda entry: sizing.rebuild_flops(config, parameters, len(entry.token_ids))
        prefix_cache = prefix_cache if prefix_cache is not None else PrefixCache()
        self.runner = ModelRunner(model, chunk_tokens, self.state_cache_dtype)
        resume_points = ResumePoints(prefix_cache, resume, snapshot_interval, self.runner.empty_state,
                                     config.tensor_parallel)
        self.cache = HybridCache(fingerprint, store, prefix_cache, resume_points, self.entry_bytes)
        self.prefiller = Prefiller(self.cache, self.runner)
        self.eos_token_ids = set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids())
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, sorted(self.eos_token_ids))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "cpu", dtype: str = "auto", seam_width: int = 8,
                        pic_separator: str = DEFAULT_SEPARATOR, public_pool_bytes: int | None = None,
                        private_pool_bytes: int | None = None, private_window_bytes: int | None = None,
                        chunk_tokens: int = 2048, snapshot_interval: int | None = None,
                        state_cache_dtype: str = "float32", tiers: TierOptions = TierOptions(),
                        eviction: Eviction = Eviction.LRU, tp: TensorParallel = TensorParallel(),
                        tp_size: int = 1, threads: int | None = 1, mode: Mode | str = Mode.HYPIC) -> "Engine":
        """Load a local HF-format checkpoint directory (config.json, *.safetensors, tokenizer.json).
        ``"default"`` loads the model shipped in the package (``hypic.default_model_path()``).
        ``dtype``: float32, bfloat16, float16, or auto (the checkpoint's; float32 on a CPU that does
        not multiply half precision natively). Pool budgets in bytes; None means unbounded
        (``private_window_bytes``: the sliding-window tails within the private pool). ``tiers``: the
        public pool's disk and Mooncake tiers (none by default); ``eviction``: the public pool's order
        (``hypic.cache.eviction``). ``tp``: this process is one rank of a tensor-parallel group and
        holds that rank's share of the model and of every cache (``hypic.parallel``). ``tp_size`` N > 1:
        this process becomes rank 0 of N, the others are started here (``threads`` torch threads each),
        and an ``hypic.scheduler.engine_group.EngineGroup`` is returned, whose ``generate``, ``warmup``
        and ``flush`` run on every rank in ``mode`` (one mode per group, as a server's loop serves).
        Without ``tp_size``, ``threads`` and ``mode`` are unused."""
        if tp_size != 1:
            return _start_group[0](path, tp_size, threads=threads, mode=mode, device=device, dtype=dtype,
                                   seam_width=seam_width, pic_separator=pic_separator,
                                   public_pool_bytes=public_pool_bytes, private_pool_bytes=private_pool_bytes,
                                   private_window_bytes=private_window_bytes, chunk_tokens=chunk_tokens,
                                   snapshot_interval=snapshot_interval, state_cache_dtype=state_cache_dtype,
                                   tiers=tiers, eviction=eviction)
        if dtype not in (*DTYPE_NAMES, "auto"):
            raise InvalidRequest(f"dtype must be auto or one of {', '.join(sorted(DTYPE_NAMES))}, got {as_written(dtype)}")
        path = default_model_path() if str(path) == "default" else Path(path)
        if not path.is_dir():
            raise InvalidRequest(f"model path {as_written(str(path))} is not a directory")
        model = load_model(path, device, resolve_dtype(dtype, path, device), tp)
        fingerprint = model_fingerprint(path)
        identity = EntryIdentity(fingerprint, model.dtype, DTYPE_NAMES.get(state_cache_dtype, torch.float32),
                                 model.config, linear_shapes(model.config), model.device)
        built = build_tiers(tiers, identity)
        return cls(model, TextTokenizer.from_dir(path), fingerprint, seam_width=seam_width,
                   pic_separator=pic_separator, store=SegmentStore(public_pool_bytes, built.public, eviction, tp),
                   prefix_cache=PrefixCache(private_pool_bytes, private_window_bytes), chunk_tokens=chunk_tokens,
                   snapshot_interval=snapshot_interval, state_cache_dtype=state_cache_dtype, resume=built.resume,
                   quantization=read_quantization(path))

    # ----- caching -------------------------------------------------------------------------
    def segment_entry(self, token_ids: tuple[int, ...], policy: ModePolicy) -> tuple[SegmentEntry, bool]:
        """A document's cached interior, built alone and offered to the public pool on a miss;
        returns (entry, was_hit)."""
        entry, key = self.cache.lookup_document(token_ids, policy)
        return (entry, True) if entry is not None else (drain(self.prefiller.document_steps(key, token_ids, policy)), False)

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
        return self.prefiller.documents_steps(policy, encoded)

    def build_steps(self, segments: list[tuple[int, ...]], mode: Mode | str = Mode.HYPIC,
                    namespace: str = "") -> Steps[list[int]]:
        """``warmup_steps`` for documents already split and tokenized (a router's share of a request)."""
        return self.prefiller.documents_steps(self._caching_policy(mode, namespace), segments)

    def _caching_policy(self, mode: Mode | str, namespace: str = "") -> ModePolicy:
        """The policy of ``mode`` in ``namespace``, which must cache segments to warm anything up."""
        policy = self.policy(mode, namespace)
        if not policy.caches_segments:
            raise InvalidRequest(f"mode {as_written(mode)} caches no segments, so there is nothing to warm up "
                                 "(warm-up needs mode hypic or naive)")
        return policy

    def _warmup_plan(self, documents: list[str], mode: Mode | str,
                     namespace: str) -> tuple[ModePolicy, list[tuple[int, ...]]]:
        policy = self._caching_policy(mode, namespace)
        encoded = self.check_documents(documents)
        needed = sum(self.entry_bytes(len(ids), mode) for ids in set(encoded))
        if not self.cache.holds_all(needed):  # they would evict each other
            raise InvalidRequest(f"the documents' cache entries take {needed} bytes, more than the public pool holds "
                                 f"({self.cache.describe()['public_pool']['budget_bytes']} bytes): warm up fewer at once, or raise --public-pool-size")
        return policy, encoded

    def weight_bytes(self) -> int:
        """Bytes of the weights and buffers this process holds (one rank's shard under tensor parallelism)."""
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def entry_bytes(self, tokens: int, mode: Mode | str = Mode.HYPIC) -> int:
        """Bytes of the public-pool entry of a ``tokens``-token document under ``mode`` (``sizing.entry_bytes``)."""
        return sizing.entry_bytes(self.model.config, self.policy(mode), tokens, self.model.dtype, self.state_cache_dtype)

    def flush(self, namespace: str | None = None,
              tiers: frozenset[str] = frozenset({"memory"})) -> tuple[int, int, dict[str, int]]:
        """Empty the tiers named in ``tiers`` (``HybridCache.flush``): ``memory``, ``disk``, ``mooncake``;
        ``namespace``: only that cache namespace's. Returns (public entries, private-pool nodes,
        entries per lower tier) dropped."""
        return self.cache.flush(namespace, tiers)

    def close(self) -> None:
        """Hand memory's entries to the lower tiers' write policy and finish their writes."""
        self.cache.close()

    # ----- prefill -------------------------------------------------------------------------
    def prefill(self, parts: PromptParts, mode: Mode | str = Mode.HYPIC, logits_from: int | None = None,
                built: BuiltForRequest = BuiltForRequest()) -> Prefill:
        """Prefill a parsed request under ``mode`` (hypic | full | prefix | naive) in one go."""
        return drain(self.prefiller.prefill_steps(self.plan(parts, mode, logits_from))).for_request(built)

    def precombine(self, parts: PromptParts, mode: Mode | str = Mode.HYPIC,
                   built: BuiltForRequest = BuiltForRequest()) -> PrefillStats | None:
        """The combine pass over the held head of ``parts`` (``held_head``), its state kept in the
        private pool, so the whole request later resumes at that head's end (a combine node does this
        while its peers' last documents are still on their way). Returns the head's stats (None:
        nothing was run); pass them on in ``built.heads`` so the request's stats count the head as
        computed for it."""
        return drain(self.prefiller.precombine_steps(self.plan(parts, mode), built))

    # ----- generation ----------------------------------------------------------------------
    def decode_step(self, state: RequestState, token: int) -> tuple[torch.Tensor, RequestState]:
        """Append one token to a request's state; returns its logits [vocab] and the new state."""
        logits, states = self.runner.decode([state], [token])
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
        prefill = (yield from self.prefiller.prefill_steps(plan)).for_request(built)
        logits, state, ttft = prefill.logits, prefill.state, time.perf_counter() - start
        state.reserve(state.length + params.max_new_tokens)
        while not sequence.finished:
            sequence.step(logits)
            if len(sequence.output_ids) == 1:
                ttft = time.perf_counter() - start
            if not sequence.finished:
                logits, state = self.decode_step(state, sequence.output_ids[-1])
        self.cache.insert_finished(state, plan.policy)
        stats = prefill.stats
        return GenerationResult(sequence.output_ids, sequence.text, stats.prompt_tokens, stats.cached_tokens,
                                stats.recomputed_tokens, ttft, time.perf_counter() - start, sequence.finish_reason or "",
                                mode, stats.segments_hit, stats.segments_missed, stats)
