"""Shared fixtures: tiny random checkpoints written by ``transformers`` (the oracle) per config."""
from pathlib import Path
from typing import Callable

import pytest

from hypic.checkpoints import TINY_VARIANTS, write_random_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(name, seed=0)`` -> directory of the named tiny checkpoint (written once per session)."""
    made: dict[tuple[str, int], Path] = {}

    def factory(name: str, seed: int = 0) -> Path:
        if (name, seed) not in made:
            model_type, overrides = TINY_VARIANTS[name]
            path = tmp_path_factory.mktemp(f"{name}-{seed}")
            made[(name, seed)] = write_random_checkpoint(path, model_type, seed, **overrides)
        return made[(name, seed)]

    return factory


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    """The default tiny Qwen3.5 text checkpoint (value/key head ratio 2, partial rotary 0.25)."""
    return checkpoint_factory("qwen3_5_text-ratio2")
