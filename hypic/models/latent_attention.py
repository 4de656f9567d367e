"""Multi-head latent attention (MLA) as Kimi-Linear's and Bailing-hybrid's full-attention layers use it:
DeepSeek-V3's projections, run in the latent space (the "absorbed" form).

Keys are [k_nope | k_rope] with k_nope = W_uk c per head from the normalised kv latent c, k_rope one
part shared by all heads; values are W_uv c. Folding W_uk into the query (q_nope W_uk per head) and
W_uv after the attention makes the layer multi-query attention over one cached head [c | k_rope]
(values: c): a token costs kv_lora_rank + rope key channels and kv_lora_rank value channels, not
heads x (nope + rope + v). Kimi-Linear rotates neither part (its model has no rotary embedding), so a
cached interior spliced at another position needs no re-rotation (the model's RoPE has width 0).
Bailing-hybrid rotates q_rope and k_rope: the model's RoPE then turns the last rope channels of the
cached head, and a spliced interior is re-rotated like any key. DeepSeek's interleaved pairs (2i, 2i + 1)
are the half-split pairs (i, i + rope / 2) after one fixed permutation of the rope channels of both
query and key, which leaves their dot products unchanged: we permute at projection and rotate as usual.
"""
import torch
from torch import nn

from ..config import ModelConfig
from ..parallel.sharding import FirstRank, Rule, Split
from .attention import AttentionGroup, AttentionInputs, causal_attention
from .norm import RMSNorm
from .rope import RotaryEmbedding


class LatentAttention(nn.Module):
    """The full-attention token mixer of Kimi-Linear; attention runs over caller-assembled KV
    (keys [1, T, kv_lora_rank + rope], values [1, T, kv_lora_rank])."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        mla, hidden, heads = config.latent_attention, config.hidden_size, config.num_attention_heads
        assert mla is not None
        self.heads, self.mla, self.query_dim = heads, mla, mla.nope_dim + mla.rope_dim
        self.scale = self.query_dim**-0.5  # of the expanded form's scores, which the absorbed ones equal
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.query_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, unit_offset=False)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * self.query_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6, unit_offset=False)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, heads * (mla.nope_dim + mla.value_dim), bias=False)
        self.o_proj = nn.Linear(heads * mla.value_dim, hidden, bias=config.attention_bias)
        if mla.output_gate:
            self.g_proj = nn.Linear(hidden, heads, bias=False)
        # interleaved pairs as half-split ones: rope channels in the order [0, 2, 4, ..., 1, 3, 5, ...]
        self.rope_order = [*range(0, mla.rope_dim, 2), *range(1, mla.rope_dim, 2)] if mla.interleaved else None
        self.whole_heads = config.whole.num_attention_heads

    def tp_rules(self) -> dict[str, Rule]:
        """Cut by heads: query rows (after the replicated q latent), kv_b_proj's [nope | value] rows, the
        output gate, the output projection's columns (its bias added once); the kv latent is shared
        by every head, so its projection and norm are replicated and each rank caches all of it."""
        heads, mla = self.whole_heads, self.mla
        query = Split(0, ((heads, self.query_dim),))
        return {"q_proj.weight": query, "q_b_proj.weight": query,
                "kv_b_proj.weight": Split(0, ((heads, mla.nope_dim + mla.value_dim),)),
                "o_proj.weight": Split(1, ((heads, mla.value_dim),)), "o_proj.bias": FirstRank(),
                "g_proj.weight": Split(0, ((heads, 1),))}

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_uk [H, nope, rank] and W_uv [H, v, rank]: kv_b_proj's rows per head."""
        per_head = self.kv_b_proj.weight.view(self.heads, self.mla.nope_dim + self.mla.value_dim, -1)
        return per_head[:, : self.mla.nope_dim], per_head[:, self.mla.nope_dim :]

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> AttentionInputs:
        """x [N, hidden] at positions [N] -> query [N, H, rank + rope] (q_nope folded through W_uk), key
        [N, 1, rank + rope] = [c | k_rope], value [N, 1, rank] = c, the rope parts rotated by ``rope``
        (which turns the last rope channels; width 0 for Kimi-Linear); the output gate [N, H] or None."""
        n, mla = x.shape[0], self.mla
        latent, shared_key = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        query_nope, query_rope = self._query(x).view(n, self.heads, self.query_dim).split(
            [mla.nope_dim, mla.rope_dim], dim=-1)
        if self.rope_order is not None:
            query_rope, shared_key = query_rope[..., self.rope_order], shared_key[..., self.rope_order]
        absorbed = torch.einsum("nhd,hdr->nhr", query_nope, self._up_projections()[0])
        query = rope.apply(torch.cat([absorbed, query_rope], dim=-1), positions)
        key = rope.apply(torch.cat([latent, shared_key], dim=-1)[:, None], positions)
        gate = self.g_proj(x) if self.mla.output_gate else None
        return AttentionInputs(query, key, latent[:, None], gate)

    def attend(self, query: torch.Tensor, runs: list[tuple[int, int]], keys: torch.Tensor,
               values: torch.Tensor, groups: list[AttentionGroup] | None = None) -> torch.Tensor:
        """Multi-query ``causal_attention`` in the latent space, then W_uv per head:
        [N, H, rank + rope] -> [N, H * value_dim]."""
        latent = causal_attention(query, runs, keys, values, self.scale, groups).view(query.shape[0], self.heads, -1)
        return torch.einsum("nhr,hvr->nhv", latent, self._up_projections()[1]).flatten(1)

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """[N, H * value_dim] -> [N, hidden]; each head times sigmoid of its gate [N, H] first, if any."""
        if gate is not None:
            attended = (attended.view(gate.shape[0], self.heads, -1) * torch.sigmoid(gate.float()).to(attended.dtype)[..., None]).flatten(1)
        return self.o_proj(attended)
