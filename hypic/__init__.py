"""HYPIC: position-independent caching for hybrid-attention LLMs."""
from .engine import Engine, GenerationResult, Prefill, PrefillStats
from .errors import CheckpointError, HypicError, InvalidRequest, UnsupportedModel
from .segments import DEFAULT_SEPARATOR

__all__ = [
    "CheckpointError", "DEFAULT_SEPARATOR", "Engine", "GenerationResult", "HypicError", "InvalidRequest",
    "Prefill", "PrefillStats", "UnsupportedModel",
]
__version__ = "0.1.0"
