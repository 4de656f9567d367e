"""The project's own small hybrid model, shipped inside the package.

A Qwen3.5-architecture checkpoint (``qwen3_5_text``: Gated DeltaNet and gated full-attention
layers, 3:1) trained by ``hypic_data.train`` on the synthetic multi-document QA data of
``hypic_data.synthetic_qa``; it answers questions about the documents of a prompt written as
``instruction <<PIC_SEP>> doc ... <<PIC_SEP>> "\\n\\nQuestion: ...\\nAnswer:"``.
``Engine.from_pretrained("default")`` loads it.
"""
from pathlib import Path

from ..errors import CheckpointError

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "default_model"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def default_model_path() -> Path:
    """Directory of the shipped default model (config.json, model.safetensors, tokenizer.json).

    Raises ``CheckpointError`` when the directory or one of its files is missing (e.g. a
    package built without its data files).
    """
    missing = [name for name in REQUIRED_FILES if not (DEFAULT_MODEL_DIR / name).is_file()]
    if missing:
        raise CheckpointError(
            f"the default model is missing from the installed package: {DEFAULT_MODEL_DIR} lacks "
            f"{', '.join(missing)}; reinstall hypic with its package data or pass a model directory")
    return DEFAULT_MODEL_DIR
