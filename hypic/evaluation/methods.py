"""The methods a study compares and how each request is run on the in-process engine.

``hypic-bf16`` is ``hypic`` with the public pool's T_C and S_C|0 stored in bfloat16 (the engine's
``state_cache_dtype``, lossy: composition still computes in fp32); ``hypic`` stores them in fp32.

Warm-up policy (``warm``): every document was seen before the timed request, in another prompt.
``hypic`` and ``naive`` cache the sample's documents (``Engine.warmup``); ``prefix`` serves one
earlier request per document, the instruction then that document (``Sample.earlier_prompts``), so
its cache holds what a prefix cache would in that scenario: the instruction and the first document
of the timed prompt, not the whole prompt; ``full`` reuses nothing. Cold (``warm=False``): every
method starts from empty pools. Every sample runs on fresh pools, so nothing carries over between
samples.
"""
from dataclasses import dataclass

from hypic import Engine, GenerationResult
from hypic.cache.modes import Mode

from .data import Sample

MODES = ("full", "prefix", "naive", "hypic")
DEFAULT_WIDTH = 8
HYPIC_STATE_DTYPES = {"hypic": "float32", "hypic-bf16": "bfloat16"}  # method name -> stored T_C and S_C|0 dtype


class MethodError(ValueError):
    """A method name that does not parse."""


@dataclass(frozen=True)
class Method:
    """An engine mode with, for hypic, its seam width and the dtype its public pool stores T_C and
    S_C|0 in."""

    mode: Mode
    seam_width: int = DEFAULT_WIDTH
    state_cache_dtype: str = "float32"

    @property
    def label(self) -> str:
        if self.mode != "hypic":
            return self.mode
        name = next(n for n, dtype in HYPIC_STATE_DTYPES.items() if dtype == self.state_cache_dtype)
        return f"{name}:{self.seam_width}"


def parse_method(text: str) -> Method:
    """``full``, ``prefix``, ``naive``, ``hypic`` (w = 8), ``hypic:W``, ``hypic-bf16`` or ``hypic-bf16:W``."""
    name, _, width = text.partition(":")
    if name not in (*MODES, *HYPIC_STATE_DTYPES) or (width and name not in HYPIC_STATE_DTYPES):
        raise MethodError(f"unknown method {text!r}: full, prefix, naive, hypic, hypic:W or hypic-bf16[:W] "
                          "(W a seam width)")
    if width and not width.isdigit():
        raise MethodError(f"method {text!r}: the seam width must be an integer >= 0")
    if name not in HYPIC_STATE_DTYPES:
        return Method(Mode(name))
    return Method(Mode.HYPIC, int(width) if width else DEFAULT_WIDTH, HYPIC_STATE_DTYPES[name])


def fresh_engine(base: Engine, sample: Sample, method: Method, warm: bool) -> Engine:
    """An engine on ``base``'s weights with empty pools, ``method``'s seam width and stored-state
    dtype, warmed for ``sample`` as the warm-up policy says (the sample's timed request not yet made)."""
    engine = Engine(base.model, base.tokenizer, base.fingerprint, seam_width=method.seam_width,
                    pic_separator=base.pic_separator, state_cache_dtype=method.state_cache_dtype)
    if warm and method.mode in ("hypic", "naive"):
        engine.warmup(list(sample.documents), method.mode)
    elif warm and method.mode == "prefix":
        for earlier in sample.earlier_prompts(engine.pic_separator):
            engine.generate(earlier, mode="prefix", max_new_tokens=1)
    return engine


def run_sample(base: Engine, sample: Sample, method: Method, warm: bool) -> GenerationResult:
    """One greedy request of ``sample`` under ``method`` on fresh pools (sharing ``base``'s weights)."""
    engine = fresh_engine(base, sample, method, warm)
    return engine.generate(sample.prompt(engine.pic_separator), mode=method.mode,
                           max_new_tokens=sample.max_new_tokens, temperature=0.0)
