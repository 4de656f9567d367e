"""One module per architecture, found through one registry keyed by ``model_type``.

Each module declares an ``Architecture`` (``base.py``): how its ``config.json`` becomes our
``ModelConfig``, where its checkpoint's names differ from ours, and a tiny random config for
tests. Adding an architecture is adding a module here and its name below; the runtime reads only
what ``ModelConfig`` says, and its linear layers' family record (``hypic.models.families``).
"""
from typing import Any

from ...config import ModelConfig
from ...errors import UnsupportedModel, as_written
from . import bailing, bailing_linear, gpt_oss, granite, kimi, mimo, minimax, nemotron_h, qwen
from .base import Architecture

ARCHITECTURES: tuple[Architecture, ...] = (
    qwen.QWEN3_NEXT, qwen.QWEN3_5, qwen.QWEN3_5_MOE, qwen.NATIVE, minimax.ARCHITECTURE, granite.ARCHITECTURE,
    kimi.ARCHITECTURE, nemotron_h.ARCHITECTURE, gpt_oss.ARCHITECTURE, mimo.ARCHITECTURE, bailing.ARCHITECTURE,
    bailing_linear.ARCHITECTURE,
)
REGISTRY: dict[str, Architecture] = {model_type: arch for arch in ARCHITECTURES for model_type in arch.model_types}
WRAPPERS: dict[str, Architecture] = {wrapper: arch for arch in ARCHITECTURES for wrapper in arch.wraps}


def architecture(model_type: str) -> Architecture:
    """The architecture of ``model_type`` (a wrapper's: the one it wraps); raises ``UnsupportedModel``."""
    found = REGISTRY.get(model_type) or WRAPPERS.get(model_type)
    if found is None:
        known = ", ".join([*REGISTRY, *WRAPPERS])
        raise UnsupportedModel(f"unknown model_type {as_written(model_type)}: HYPIC runs {known}")
    return found


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``raw`` itself, or a multimodal wrapper's ``text_config``."""
    model_type = raw.get("model_type")
    architecture(str(model_type))
    if model_type not in WRAPPERS:
        return raw
    text = dict(raw.get("text_config") or {})
    text.setdefault("model_type", f"{model_type}_text")
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    text.setdefault("eos_token_id", raw.get("eos_token_id"))
    return text


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """A loaded ``config.json`` as our ``ModelConfig``; raises ``UnsupportedModel``."""
    text = text_config(raw)
    try:
        return architecture(text["model_type"]).parse(text, raw)
    except KeyError as missing:
        raise UnsupportedModel(f"config.json lacks the field {as_written(missing.args[0])}") from None


__all__ = ["ARCHITECTURES", "Architecture", "architecture", "parse_config", "text_config"]
