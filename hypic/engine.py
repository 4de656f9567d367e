"""``hypic.Engine``: load a checkpoint, cache segments, prefill in four modes, generate."""
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .assembler import combine
from .errors import InvalidRequest
from .loader import load_model, model_fingerprint
from .models import HybridModel
from .sampling import SamplingParams, sample
from .segment_prefill import prefill_interior, prefill_leading
from .segments import DEFAULT_SEPARATOR, Piece, PromptParts, Run, build_layout, has_interior, split_prompt
from .state import RequestState
from .store import PrefixEntry, Role, SegmentEntry, SegmentStore, entry_key
from .tokenizer import TextTokenizer

MODES = ("hypic", "full", "prefix", "naive")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PrefillStats:
    """What the prefill of one request reused and recomputed."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    segments_hit: int = 0
    segments_missed: int = 0
    combine_tokens: int = 0  # tokens run in the combine pass (seams, Q, unspliced segments)

    @property
    def recomputed_tokens(self) -> int:
        """Every prompt token whose state was computed for this request."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class Prefill:
    """A prefilled request: first-token logits [vocab] and the state decode continues from."""

    logits: torch.Tensor
    state: RequestState
    stats: PrefillStats


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
    mode: str
    segments_hit: int = 0
    segments_missed: int = 0
    stats: PrefillStats = field(default_factory=PrefillStats, repr=False)


class Engine:
    """A hybrid model with a segment store. Not thread-safe: one request at a time."""

    def __init__(self, model: HybridModel, tokenizer: TextTokenizer, fingerprint: str, *,
                 seam_width: int = 8, pic_separator: str = DEFAULT_SEPARATOR, store: SegmentStore | None = None) -> None:
        if not isinstance(seam_width, int) or seam_width < 0:
            raise InvalidRequest(f"seam_width must be an integer >= 0, got {seam_width!r}")
        if not pic_separator:
            raise InvalidRequest("pic_separator must be a non-empty string")
        self.model, self.tokenizer, self.fingerprint = model, tokenizer, fingerprint
        self.seam_width, self.pic_separator = seam_width, pic_separator
        self.store = store if store is not None else SegmentStore()
        self.eos_token_ids = set(model.config.eos_token_ids) | set(tokenizer.eos_token_ids())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "cpu", dtype: str = "float32", seam_width: int = 8,
                        pic_separator: str = DEFAULT_SEPARATOR) -> "Engine":
        """Load a local HF-format checkpoint directory (config.json, *.safetensors, tokenizer.json)."""
        if dtype not in DTYPES:
            raise InvalidRequest(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        path = Path(path)
        if not path.is_dir():
            raise InvalidRequest(f"model path {str(path)!r} is not a directory")
        model = load_model(path, device, DTYPES[dtype])
        return cls(model, TextTokenizer.from_dir(path), model_fingerprint(path),
                   seam_width=seam_width, pic_separator=pic_separator)

    # ----- caching -------------------------------------------------------------------------
    def _leading_state(self, leading: tuple[int, ...], stats: PrefillStats) -> RequestState:
        """L's running state, from the store or prefilled now (position-dependent, cached in full)."""
        if not leading:
            return RequestState.empty(self.model.config, self.model.device, self.model.dtype)
        key = entry_key(self.fingerprint, 0, Role.LEADING, leading)
        entry = self.store.get(key, leading)
        if isinstance(entry, PrefixEntry):
            stats.cached_tokens += len(leading)
            return entry.state
        state = prefill_leading(self.model, leading)
        self.store.put(PrefixEntry(key, leading, state))
        return state

    def segment_entry(self, token_ids: tuple[int, ...], seam_width: int, role: Role = Role.SEGMENT) -> tuple[SegmentEntry, bool]:
        """The cached interior of a segment (prefilled alone on a miss); returns (entry, was_hit)."""
        key = entry_key(self.fingerprint, seam_width, role, token_ids)
        entry = self.store.get(key, token_ids)
        if isinstance(entry, SegmentEntry):
            return entry, True
        layers = prefill_interior(self.model, token_ids, seam_width)
        entry = SegmentEntry(key, token_ids, seam_width, seam_width, len(token_ids) - 2 * seam_width, layers)
        self.store.put(entry)
        return entry, False

    def warmup(self, documents: list[str]) -> list[int]:
        """Cache each document as a PIC segment; returns each document's token count.
        Documents too short to have an interior (<= 2w tokens) are counted but not cached."""
        if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
            raise InvalidRequest("documents must be a list of strings")
        encoded = [tuple(self.tokenizer.encode(d)) for d in documents]
        for index, ids in enumerate(encoded):
            if not ids:
                raise InvalidRequest(f"document {index} is empty")
        for ids in encoded:
            if has_interior(len(ids), self.seam_width):
                self.segment_entry(ids, self.seam_width)
        return [len(ids) for ids in encoded]

    # ----- prefill -------------------------------------------------------------------------
    def parse(self, prompt: str) -> PromptParts:
        """Split and tokenize a prompt, checking it fits the model's positions."""
        parts = split_prompt(prompt, self.tokenizer.encode, self.pic_separator)
        limit = self.model.config.max_position_embeddings
        if len(parts.token_ids) > limit:
            raise InvalidRequest(f"the prompt has {len(parts.token_ids)} tokens, over the model's limit of {limit}")
        return parts

    def _splice_entries(self, parts: PromptParts, seam_width: int, role: Role,
                        stats: PrefillStats) -> dict[int, SegmentEntry]:
        entries = {}
        for index, segment in enumerate(parts.segments):
            if has_interior(len(segment), seam_width):
                entries[index], hit = self.segment_entry(segment, seam_width, role)
                stats.segments_hit += hit
                stats.segments_missed += not hit
                stats.cached_tokens += entries[index].length if hit else 0
        return entries

    def prefill(self, parts: PromptParts, mode: str = "hypic") -> Prefill:
        """Prefill a parsed request under ``mode`` (hypic | full | prefix | naive)."""
        if mode not in MODES:
            raise InvalidRequest(f"mode must be one of {MODES}, got {mode!r}")
        ids = parts.token_ids
        stats = PrefillStats(prompt_tokens=len(ids))
        if mode == "full":
            init, entries = RequestState.empty(self.model.config, self.model.device, self.model.dtype), {}
            pieces: list[Piece] = [Run(0, len(ids))]
        else:
            init = self._leading_state(parts.leading, stats)
            width = {"hypic": self.seam_width, "naive": 0, "prefix": None}[mode]
            role = Role.NAIVE_SEGMENT if mode == "naive" else Role.SEGMENT
            entries = {} if width is None else self._splice_entries(parts, width, role, stats)
            pieces = build_layout(parts, width or 0, set(entries))
        stats.combine_tokens = sum(p.length for p in pieces if isinstance(p, Run))
        result = combine(self.model, ids, pieces, init, entries, naive=mode == "naive")
        assert result.logits is not None
        return Prefill(result.logits, result.state, stats)

    # ----- generation ----------------------------------------------------------------------
    def _finished(self, token: int, params: SamplingParams, produced: int, length: int) -> str | None:
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if produced >= params.max_new_tokens or length >= self.model.config.max_position_embeddings:
            return "length"
        return None

    def decode_step(self, state: RequestState, token: int) -> tuple[torch.Tensor, RequestState]:
        """Append one token to a request's state; returns its logits [vocab] and the new state."""
        ids = state.token_ids + [token]
        result = combine(self.model, ids, [Run(state.length, 1)], state)
        assert result.logits is not None
        return result.logits, result.state

    def generate(self, prompt: str, *, max_new_tokens: int = 16, temperature: float = 0.0, mode: str = "hypic",
                 top_p: float = 1.0, top_k: int = -1, stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
                 seed: int | None = None) -> GenerationResult:
        """Prefill ``prompt`` (separators mark PIC segments) under ``mode`` and decode."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, tuple(stop_token_ids), ignore_eos, seed)
        start = time.perf_counter()
        prefill = self.prefill(self.parse(prompt), mode)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        logits, state, output, reason = prefill.logits, prefill.state, [], "length"
        ttft = time.perf_counter() - start
        while params.max_new_tokens > 0:
            token = sample(logits, params, generator)
            output.append(token)
            if len(output) == 1:
                ttft = time.perf_counter() - start
            finished = self._finished(token, params, len(output), state.length + 1)
            if finished:
                reason = finished
                break
            logits, state = self.decode_step(state, token)
        stats = prefill.stats
        return GenerationResult(output, self.tokenizer.decode(output), stats.prompt_tokens, stats.cached_tokens,
                                stats.recomputed_tokens, ttft, time.perf_counter() - start, reason, mode,
                                stats.segments_hit, stats.segments_missed, stats)
