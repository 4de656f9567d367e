"""Every linear-attention family, found through one registry keyed by ``ModelConfig.linear_family``.

Each family's module declares a ``LinearFamily`` (``linear.py``): its mixer, kernels, transition
structure, state shape and checkpoint names. Adding a family is adding its module (and its kernels)
and its record below; a test may ``register`` one of its own.
"""
import torch

from ..config import ModelConfig
from ..errors import UnsupportedModel, as_written
from ..state import LinearShapes, RequestState
from . import gated_deltanet, gla, kimi_delta, lightning, mamba2, rotary_linear
from .linear import LinearFamily

FAMILIES: dict[str, LinearFamily] = {}


def register(family: LinearFamily) -> LinearFamily:
    """Make ``family`` nameable by a config; a name is registered once."""
    if FAMILIES.get(family.name, family) is not family:
        raise ValueError(f"a linear family named {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


for _family in (gated_deltanet.FAMILY, lightning.FAMILY, mamba2.FAMILY, gla.FAMILY, rotary_linear.FAMILY,
                kimi_delta.FAMILY):
    register(_family)


def linear_family(name: str) -> LinearFamily:
    """The family named ``name``; raises ``UnsupportedModel``."""
    if name not in FAMILIES:
        raise UnsupportedModel(f"unknown linear family {as_written(name)}: one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(config: ModelConfig) -> LinearFamily:
    """The family of ``config``'s linear layers."""
    return linear_family(config.linear_family)


def linear_shapes(config: ModelConfig) -> LinearShapes:
    """What each linear layer of ``config`` holds (its family's ``LinearFamily.shapes``)."""
    return family_of(config).shapes(config)


def empty_state(config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> RequestState:
    """The zero state of a ``config`` model before any token (``RequestState.empty`` with its family's shapes)."""
    return RequestState.empty(config, device, dtype, linear_shapes(config))


def native_families() -> tuple[str, ...]:
    """The families a ``hypic_hybrid`` config may name."""
    return tuple(name for name, family in FAMILIES.items() if family.native is not None)


__all__ = ["FAMILIES", "LinearFamily", "empty_state", "family_of", "linear_family", "linear_shapes",
           "native_families", "register"]
