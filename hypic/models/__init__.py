"""The hybrid model runtime: layers of the Qwen3-Next / Qwen3.5 families."""
from .hybrid import DecoderLayer, HybridModel

__all__ = ["DecoderLayer", "HybridModel"]
