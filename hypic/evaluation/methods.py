"""The methods a study compares and how each request is run on the in-process engine.

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


class MethodError(ValueError):
    """A method name that does not parse."""


@dataclass(frozen=True)
class Method:
    """An engine mode with, for hypic, its seam width."""

    mode: Mode
    seam_width: int = DEFAULT_WIDTH

    @property
    def label(self) -> str:
        return f"hypic:{self.seam_width}" if self.mode == "hypic" else self.mode


def parse_method(text: str) -> Method:
    """``full``, ``prefix``, ``naive``, ``hypic`` (w = 8) or ``hypic:W``."""
    mode, _, width = text.partition(":")
    if mode not in MODES or (width and mode != "hypic"):
        raise MethodError(f"unknown method {text!r}: full, prefix, naive, hypic or hypic:W (W a seam width)")
    if not width:
        return Method(Mode(mode))
    if not width.isdigit():
        raise MethodError(f"method {text!r}: the seam width must be an integer >= 0")
    return Method(Mode(mode), int(width))


def fresh_engine(base: Engine, sample: Sample, method: Method, warm: bool) -> Engine:
    """An engine on ``base``'s weights with empty pools and ``method``'s seam width, warmed for
    ``sample`` as the warm-up policy says (the sample's timed request not yet made)."""
    engine = Engine(base.model, base.tokenizer, base.fingerprint, seam_width=method.seam_width,
                    pic_separator=base.pic_separator)
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
