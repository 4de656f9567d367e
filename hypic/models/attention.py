"""Full attention: Qwen3-Next / Qwen3.5's gated form (q/k RMSNorm, partial rotary, sigmoid output
gate), or without gate and q/k norms (``config.attention_output_gate`` False: MiniMax)."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from ..config import ModelConfig
from .norm import RMSNorm
from .rope import RotaryEmbedding



@dataclass
class AttentionInputs:
    """Per-token projections of one full-attention layer for N tokens."""

    query: torch.Tensor  # [N, Hq, D], rotated
    key: torch.Tensor  # [N, Hkv, D], rotated
    value: torch.Tensor  # [N, Hkv, D]
    gate: torch.Tensor | None  # [N, Hq * D]; None without an output gate


def causal_attention(query: torch.Tensor, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """query [N, Hq, Dk] in runs of consecutive positions, each given as (first position, length)
    (host integers: no device sync); keys [Hkv, T, Dk], values [Hkv, T, Dv] at positions 0..T-1. Each
    query sees the keys at positions <= its own: one causal (lower-right aligned) attention per run
    over the keys up to its end. Returns [N, Hq * Dv]; GQA groups share their K/V without copies."""
    outputs, lo = [], 0
    for first, run in runs:
        end = first + run
        q = query[lo : lo + run].transpose(0, 1)[None]
        mask = causal_lower_right(run, end) if run > 1 else None
        out = F.scaled_dot_product_attention(q, keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                                             scale=scale, enable_gqa=query.shape[1] != keys.shape[0])
        outputs.append(out[0].transpose(0, 1))
        lo += run
    return torch.cat(outputs).reshape(query.shape[0], -1)


class GatedAttention(nn.Module):
    """The full-attention token mixer; attention itself runs over caller-assembled KV."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim
        self.gated = config.attention_output_gate
        self.scale = dim**-0.5 if config.attention_scale is None else config.attention_scale
        self.q_proj = nn.Linear(hidden, heads * dim * (2 if self.gated else 1), bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=config.attention_bias)
        if self.gated:
            self.q_norm = RMSNorm(dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> AttentionInputs:
        """x [N, hidden] at global positions [N] -> rotated q, k, v and the output gate."""
        n = x.shape[0]
        key, value = self.k_proj(x).view(n, self.kv_heads, self.head_dim), self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if not self.gated:
            query = self.q_proj(x).view(n, self.heads, self.head_dim)
            return AttentionInputs(rope.apply(query, positions), rope.apply(key, positions), value, None)
        query, gate = self.q_proj(x).view(n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = rope.apply(self.q_norm(query), positions)
        return AttentionInputs(query, rope.apply(self.k_norm(key), positions), value, gate.reshape(n, -1))

    def attend(self, query: torch.Tensor, runs: list[tuple[int, int]], keys: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        """``causal_attention`` with this layer's scale: [N, Hq, D] -> [N, Hq * D]."""
        return causal_attention(query, runs, keys, values, self.scale)

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self.o_proj(attended if gate is None else attended * torch.sigmoid(gate))
