"""HYPIC: position-independent caching for hybrid-attention LLMs.

Where a docstring or comment cites an equation, section, figure or table of "the paper", it is
"HYPIC: Accelerating Hybrid-Attention LLM Serving with Position-Independent Caching" (Liu, Wu
et al.). How a request flows through the modules: docs/architecture.md.
"""
from .default_model import default_model_path
from .engine import Engine, GenerationResult, Prefill, PrefillStats
from .errors import CheckpointError, HypicError, InvalidRequest, UnsupportedModel
from .cache.segments import DEFAULT_SEPARATOR
from .scheduler import engine_group as _engine_group  # noqa: F401 - Engine.from_pretrained(tp_size=N)'s driver

__all__ = [
    "CheckpointError", "DEFAULT_SEPARATOR", "Engine", "GenerationResult", "HypicError", "InvalidRequest",
    "Prefill", "PrefillStats", "UnsupportedModel", "default_model_path",
]
__version__ = "0.1.0"
