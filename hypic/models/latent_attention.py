"""Multi-head latent attention (MLA) as Kimi-Linear's full-attention layers use it: DeepSeek-V3's
projections without RoPE.

Keys are [k_nope | k_rope]: k_nope per head from the normalised kv latent, k_rope one part shared by
all heads; values come from the same latent. Kimi-Linear rotates neither part (its model has no
rotary embedding), so keys are cached expanded per head and a cached interior spliced at another
position needs no re-rotation (the model's RoPE has width 0).
"""
import torch
from torch import nn

from ..config import ModelConfig
from .attention import AttentionInputs, causal_attention
from .norm import RMSNorm
from .rope import RotaryEmbedding


class LatentAttention(nn.Module):
    """The full-attention token mixer of Kimi-Linear; attention runs over caller-assembled KV
    (keys [H, T, nope + rope], values [H, T, value_dim])."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla, hidden, heads = config.latent_attention, config.hidden_size, config.num_attention_heads
        assert mla is not None
        self.heads, self.mla, self.head_dim = heads, mla, mla.nope_dim + mla.rope_dim
        self.scale = self.head_dim**-0.5
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, unit_offset=False)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6, unit_offset=False)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.nope_dim + mla.value_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.value_dim, hidden, bias=config.attention_bias)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> AttentionInputs:
        """x [N, hidden] -> query, key [N, H, nope + rope], value [N, H, value_dim]; no rotation
        (``positions`` and ``rope`` are taken for the common interface)."""
        n, mla = x.shape[0], self.mla
        latent, shared_key = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.rope_dim], dim=-1)
        key_nope, value = self.kv_b_proj(self.kv_a_layernorm(latent)).view(n, self.heads, -1).split(
            [mla.nope_dim, mla.value_dim], dim=-1)
        key = torch.cat([key_nope, shared_key[:, None].expand(n, self.heads, mla.rope_dim)], dim=-1)
        return AttentionInputs(self._query(x).view(n, self.heads, self.head_dim), key, value.contiguous(), None)

    def attend(self, query: torch.Tensor, runs: list[tuple[int, int]], keys: torch.Tensor,
               values: torch.Tensor) -> torch.Tensor:
        """``causal_attention`` at scale (nope + rope) ** -0.5: [N, H, Dk] -> [N, H * value_dim]."""
        return causal_attention(query, runs, keys, values, self.scale)

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self.o_proj(attended)
