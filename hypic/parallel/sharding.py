"""How a model is cut over tensor-parallel ranks.

``rank_config`` turns a model's config into one rank's: the same model with 1/N of the heads and of
the MLP and expert widths (KV or key heads fewer than N are replicated, as SGLang does). Every part of
HYPIC sized from the config (layers, states, arenas, cache entries) then holds exactly one rank's
share. Each module says how its checkpoint tensors are cut (``tp_rules``: a ``Split`` or
``FirstRank`` per parameter, anything unnamed is replicated); ``take`` cuts a full tensor.
"""
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import UnsupportedModel
from .group import TensorParallel


@dataclass(frozen=True)
class Split:
    """A parameter cut along ``dim``. ``blocks``: the consecutive blocks along that dimension, each
    (units, unit size), e.g. [q | k | v] by heads; a rank takes its 1/N of every block's units, or when
    a block has fewer units than ranks (KV heads), the one unit its rank group shares. Empty: the
    whole dimension cut into N equal parts."""

    dim: int = 0
    blocks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class FirstRank:
    """A bias added after an all-reduce: rank 0 holds it, the other ranks zeros (added once)."""


Rule = Split | FirstRank


def units_of_rank(units: int, tp: TensorParallel) -> tuple[int, int]:
    """(first unit, count) of ``units`` equal units held by this rank; fewer units than ranks: each
    unit is held by size / units consecutive ranks."""
    if units % tp.size == 0:
        return tp.rank * (units // tp.size), units // tp.size
    if tp.size % units == 0:
        return tp.rank * units // tp.size, 1
    raise UnsupportedModel(f"{units} heads cannot be split over {tp.size} tensor-parallel ranks")


def take(tensor: torch.Tensor, rule: Rule | None, tp: TensorParallel) -> torch.Tensor:
    """This rank's share of the full ``tensor`` (all of it when ``rule`` is None: replicated)."""
    if rule is None or not tp.enabled:
        return tensor
    if isinstance(rule, FirstRank):
        return tensor if tp.rank == 0 else torch.zeros_like(tensor)
    dim = rule.dim % tensor.dim()
    blocks = rule.blocks or ((tp.size, tensor.shape[dim] // tp.size),)
    pieces, at = [], 0
    for units, size in blocks:
        first, count = units_of_rank(units, tp)
        pieces.append(tensor.narrow(dim, at + first * size, count * size))
        at += units * size
    if at != tensor.shape[dim]:
        raise UnsupportedModel(f"a tensor of shape {tuple(tensor.shape)} does not have the {at} rows along "
                               f"dimension {dim} its blocks {blocks} describe")
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def sharding_rules(model: nn.Module) -> dict[str, Rule]:
    """Every cut parameter of ``model`` by its full name (from each module's ``tp_rules``)."""
    rules: dict[str, Rule] = {}
    for prefix, module in model.named_modules():
        declared = getattr(module, "tp_rules", None)
        if declared is not None:
            rules.update({f"{prefix}.{name}" if prefix else name: rule for name, rule in declared().items()})
    return rules


def _divided(name: str, value: int, tp: TensorParallel, replicable: bool = False) -> int:
    """``value`` / N, or 1 for a replicable count that divides N; else the model is refused."""
    if value % tp.size == 0:
        return value // tp.size
    if replicable and tp.size % value == 0:
        return 1
    raise UnsupportedModel(f"{name} = {value} is not divisible by the tensor-parallel size {tp.size}"
                           + (" (nor divides it)" if replicable else ""))


def rank_config(config: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """One rank's config: heads and widths divided by N (refused, naming the count, where they do not
    divide); the full config stays reachable as ``unsharded``."""
    if not tp.enabled:
        return config
    window = config.sliding_window
    if window is not None and window.kv_heads is not None:
        window = dataclasses.replace(window, kv_heads=_divided("sliding-window KV heads", window.kv_heads, tp, True))
    linear = bool(config.linear_layers())
    layers = range(config.num_hidden_layers)
    dense = any(config.has_feed_forward(i) and not config.is_moe_layer(i) for i in layers)
    return dataclasses.replace(
        config,
        num_attention_heads=_divided("num_attention_heads", config.num_attention_heads, tp),
        num_key_value_heads=_divided("num_key_value_heads", config.num_key_value_heads, tp, True),
        linear_num_key_heads=(_divided("linear_num_key_heads", config.linear_num_key_heads, tp, True)
                              if linear else config.linear_num_key_heads),
        linear_num_value_heads=(_divided("linear_num_value_heads", config.linear_num_value_heads, tp)
                                if linear else config.linear_num_value_heads),
        intermediate_size=(_divided("intermediate_size", config.intermediate_size, tp) if dense
                           else config.intermediate_size),
        moe_intermediate_size=_divided("moe_intermediate_size", config.moe_intermediate_size, tp),
        shared_expert_intermediate_size=_divided("shared_expert_intermediate_size",
                                                 config.shared_expert_intermediate_size, tp),
        sliding_window=window, tensor_parallel=tp, unsharded=config)
