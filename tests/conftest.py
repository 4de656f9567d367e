"""Shared fixtures: tiny random checkpoints written by ``transformers`` (the oracle) per config."""
from pathlib import Path
from typing import Any, Callable

import pytest

from hypic.checkpoints import MOE_CONFIG, write_random_checkpoint

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_5_text-ratio2": ("qwen3_5_text", {}),
    "qwen3_5_text-ratio1": ("qwen3_5_text", dict(linear_num_value_heads=2)),
    "qwen3_5_text-full-rotary": ("qwen3_5_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 1.0})),
    "qwen3_next-moe": ("qwen3_next", dict(MOE_CONFIG)),
    "qwen3_next-dense": ("qwen3_next", dict(num_experts=0)),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(MOE_CONFIG)),
    "qwen3_5-wrapper": ("qwen3_5", {}),
}


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(name, seed=0)`` -> directory of the named tiny checkpoint (written once per session)."""
    made: dict[tuple[str, int], Path] = {}

    def factory(name: str, seed: int = 0) -> Path:
        if (name, seed) not in made:
            model_type, overrides = CONFIGS[name]
            path = tmp_path_factory.mktemp(f"{name}-{seed}")
            made[(name, seed)] = write_random_checkpoint(path, model_type, seed, **overrides)
        return made[(name, seed)]

    return factory


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    """The default tiny Qwen3.5 text checkpoint (value/key head ratio 2, partial rotary 0.25)."""
    return checkpoint_factory("qwen3_5_text-ratio2")
