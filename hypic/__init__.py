"""HYPIC: position-independent caching for hybrid-attention LLMs.

Where a docstring or comment cites an equation, section, figure or table of "the paper", it is
"HYPIC: Accelerating Hybrid-Attention LLM Serving with Position-Independent Caching" (Liu, Wu
et al.). How a request flows through the modules: docs/architecture.md.
"""
from .loading.default_model import default_model_path
from .engine import Engine, GenerationResult, Prefill, PrefillStats, serve_groups_with
from .errors import CheckpointError, HypicError, InvalidRequest, UnsupportedModel
from .cache.segments import DEFAULT_SEPARATOR
from .scheduler.engine_group import EngineGroup

serve_groups_with(EngineGroup)  # Engine.from_pretrained(tp_size=N)'s driver: the engine sits below the scheduler

__all__ = [
    "CheckpointError", "DEFAULT_SEPARATOR", "Engine", "GenerationResult", "HypicError", "InvalidRequest",
    "Prefill", "PrefillStats", "UnsupportedModel", "default_model_path",
]
__version__ = "0.1.0"
