"""Synthetic multi-document QA data, its tokenizer, and a small hybrid model trained on it.

Installed as ``hypic_data``, beside the serving package: ``hypic`` (the server, the engine, the
caches) never imports it (``tests/docs/test_rooms.py``); ``hypic eval`` reads its generator.

Modules (each also a command line, ``python -m hypic_data.<module> --help``):

- ``synthetic_qa``: the deterministic dataset generator and the prompt builders;
- ``tokenizer``: the byte-level BPE tokenizer trained on the generated corpus;
- ``train``: training of a small Qwen3.5-architecture hybrid model;
- ``evaluate``: exact-match accuracy of a prompt -> answer function on a split.

The dataset helpers are re-exported lazily, so that running a submodule with ``-m``
does not import it twice.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = (
    "DEFAULT_SEPARATOR",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "GeneratorConfig",
    "build_prompt",
    "build_training_text",
    "generate_example",
    "generate_split",
    "prompt_parts",
    "read_jsonl",
)
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Resolve the re-exported names of ``hypic_data.synthetic_qa`` on first use."""
    if name in _EXPORTS:
        return getattr(importlib.import_module("hypic_data.synthetic_qa"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
