"""Shared fixtures: tiny random checkpoints written by ``transformers`` (the oracle) per config."""
import shutil
from pathlib import Path
from typing import Callable

import pytest

from hypic.loading.checkpoints import write_random_checkpoint
from hypic_testing.checkpoints import make_long_memory
from hypic_testing.tiny_models import (FAMILY_CHECKPOINTS, NATIVE_VARIANTS, PUBLISHED_VARIANTS, TINY_VARIANTS,
                                       write_native_checkpoint, write_published_checkpoint)
from hypic_reference.model import ReferenceModel


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(name, seed=0, long_memory=False)`` -> directory of the named tiny checkpoint (written
    once per session); ``long_memory``: its long-memory copy (``hypic_testing.checkpoints.make_long_memory``)."""
    made: dict[tuple[str, int, bool], Path] = {}

    def factory(name: str, seed: int = 0, long_memory: bool = False) -> Path:
        if (name, seed, long_memory) not in made:
            path = tmp_path_factory.mktemp(f"{name}-{seed}{'-long' if long_memory else ''}")
            if name in NATIVE_VARIANTS:
                family, overrides = NATIVE_VARIANTS[name]
                write_native_checkpoint(path, family, seed, **overrides)
            elif name in PUBLISHED_VARIANTS:
                model_type, overrides = PUBLISHED_VARIANTS[name]
                write_published_checkpoint(path, model_type, seed, **overrides)
            else:
                model_type, overrides = TINY_VARIANTS[name]
                write_random_checkpoint(path, model_type, seed, **overrides)
            made[(name, seed, long_memory)] = make_long_memory(path) if long_memory else path
        return made[(name, seed, long_memory)]

    return factory


@pytest.fixture(params=FAMILY_CHECKPOINTS)
def family_checkpoint(request: pytest.FixtureRequest, checkpoint_factory: Callable[..., Path]) -> Path:
    """The tiny checkpoint of each linear-attention family (Gated DeltaNet, Kimi Delta Attention: dense T;
    Lightning, Mamba2 (Granite, Nemotron-H) and scalar decay with RoPE in the state: scalar T; GLA: diagonal T)."""
    return checkpoint_factory(request.param)


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory: Callable[..., Path]) -> Path:
    """The default tiny Qwen3.5 text checkpoint (value/key head ratio 2, partial rotary 0.25)."""
    return checkpoint_factory("qwen3_5_text-ratio2")


@pytest.fixture
def tiny_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint, for a test that edits its files."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


@pytest.fixture(scope="session")
def reference_factory() -> Callable[[Path], ReferenceModel]:
    """``factory(path)`` -> the independent reference model of a checkpoint (loaded once per session)."""
    loaded: dict[Path, ReferenceModel] = {}

    def factory(path: Path) -> ReferenceModel:
        if path not in loaded:
            loaded[path] = ReferenceModel(path)
        return loaded[path]

    return factory
