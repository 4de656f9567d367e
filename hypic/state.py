"""Per-request running state: what decode continues from (the private pool's unit)."""
from dataclasses import dataclass, field

import torch

from .config import ModelConfig


@dataclass
class LinearLayerState:
    """Recurrent state [Hv, K, V] fp32 and conv window [k-1, C] of one Gated DeltaNet layer."""

    recurrent: torch.Tensor
    conv: torch.Tensor


@dataclass
class AttentionLayerState:
    """Keys (rotated at their global positions) and values [Hkv, T, D] of one full-attention layer."""

    keys: torch.Tensor
    values: torch.Tensor


LayerState = LinearLayerState | AttentionLayerState


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class RequestState:
    """State of every layer after ``length`` tokens at positions 0..length-1. ``marks``: the PIC
    layout it was assembled under (position -> ``segments.PartMark`` bits; empty when exact)."""

    layers: list[LayerState]
    length: int = 0
    token_ids: list[int] = field(default_factory=list)
    marks: dict[int, int] = field(default_factory=dict)

    @classmethod
    def empty(cls, config: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> "RequestState":
        """The zero state before any token."""
        channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim
        channels += config.linear_num_value_heads * config.linear_value_head_dim
        layers: list[LayerState] = []
        for kind in config.layer_types:
            if kind == "linear_attention":
                recurrent = torch.zeros(config.linear_num_value_heads, config.linear_key_head_dim,
                                        config.linear_value_head_dim, device=device)
                layers.append(LinearLayerState(recurrent, torch.zeros(config.linear_conv_kernel_dim - 1, channels,
                                                                      device=device, dtype=dtype)))
            else:
                kv = torch.zeros(config.num_key_value_heads, 0, config.head_dim, device=device, dtype=dtype)
                layers.append(AttentionLayerState(kv, kv.clone()))
        return cls(layers)

    @property
    def nbytes(self) -> int:
        """Exact tensor bytes held by this state."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearLayerState):
                total += _nbytes(layer.recurrent, layer.conv)
            else:
                total += _nbytes(layer.keys, layer.values)
        return total
