"""The hybrid decoder stack; token mixing across positions is driven by the assembler."""
import torch
from torch import nn

from ..config import ModelConfig
from ..parallel import all_gather_last, all_reduce
from ..parallel.sharding import Rule, Split
from .attention import GatedAttention
from .families import family_of
from .latent_attention import LatentAttention
from .linear import LinearMixer
from .mlp import MLP, ExpertOptions, SparseMoE
from .norm import RMSNorm
from .rope import RotaryEmbedding


def full_attention(config: ModelConfig, index: int) -> GatedAttention | LatentAttention:
    """The attention mixer: latent attention (Kimi-Linear) or q/k/v projections (the others, full or sliding-window)."""
    return GatedAttention(config, index) if config.latent_attention is None else LatentAttention(config)


def decoder_norm(config: ModelConfig) -> RMSNorm:
    """A norm of the residual stream (before each sublayer, and the final one)."""
    return RMSNorm(config.hidden_size, config.rms_norm_eps, config.rms_norm_unit_offset,
                   config.norm_weight_in_fp32)


def feed_forward(config: ModelConfig, index: int) -> MLP | SparseMoE | None:
    """Layer ``index``'s MLP or MoE (None: a Nemotron-H mixer block with no feed-forward block after it)."""
    if not config.has_feed_forward(index):
        return None
    if not config.is_moe_layer(index):
        return MLP(config.hidden_size, config.intermediate_size, config.mlp_activation)
    return SparseMoE(config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                     config.shared_expert_intermediate_size, config.norm_topk_prob,
                     ExpertOptions(config.shared_expert_gated, config.routing, config.mlp_activation, config.moe_latent_size,
                                   config.swiglu_clamp, config.expert_bias, config.tensor_parallel.size))


class DecoderLayer(nn.Module):
    """Token mixer (linear or full attention), then MLP or MoE (or none: Nemotron-H); pre-norm residuals
    (x + f(norm(x))), or MiniMax's scaled post-norm ones (alpha * norm(x) + beta * f(norm(x)))."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.is_linear = config.layer_types[index] == "linear_attention"
        self.mixer: LinearMixer | GatedAttention | LatentAttention = (
            family_of(config).build(config, index) if self.is_linear else full_attention(config, index))
        self.mlp: MLP | SparseMoE | None = feed_forward(config, index)
        self.input_layernorm = decoder_norm(config)
        if self.mlp is not None:
            self.post_attention_layernorm = decoder_norm(config)
        scales = config.residual_scales
        self.mixer_scales = None if scales is None else scales.linear if self.is_linear else scales.full
        self.mlp_scales = None if scales is None else scales.mlp
        self.multiplier = config.residual_multiplier
        self.tp = config.tensor_parallel

    def residual(self, x: torch.Tensor, h: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        """The stream after the token mixer: x [N, hidden] the block's input, h its norm, ``mixed``
        the mixer's output of h (this rank's partial sum under tensor parallelism)."""
        mixed = all_reduce(mixed, self.tp)
        if self.mixer_scales is None:
            return x + mixed * self.multiplier if self.multiplier != 1 else x + mixed
        alpha, beta = self.mixer_scales
        return h * alpha + mixed * beta

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual MLP half of the block; x [N, hidden]."""
        if self.mlp is None:
            return x
        h = self.post_attention_layernorm(x)
        out = all_reduce(self.mlp(h), self.tp)
        if self.mlp_scales is None:
            return x + out * self.multiplier if self.multiplier != 1 else x + out
        alpha, beta = self.mlp_scales
        return h * alpha + out * beta


def _ropes(config: ModelConfig, device: torch.device | str) -> dict[str, RotaryEmbedding]:
    """One rotary embedding per attention layer kind."""
    return {kind: RotaryEmbedding(config.rope_of(kind), config.head_dim, device)
            for kind in ("full_attention", "sliding_attention")}


class HybridModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head of a hybrid text model (every family of ``config``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = decoder_norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.ropes = _ropes(config, "cpu")
        self.tp = config.tensor_parallel
        self.vocab_parallel = self.tp.enabled and config.vocab_size % self.tp.size == 0
        if self.vocab_parallel:  # each rank holds a contiguous 1/N of the vocabulary's rows
            shard = config.vocab_size // self.tp.size
            self.embed_tokens = nn.Embedding(shard, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, shard, bias=False)

    def tp_rules(self) -> dict[str, Rule]:
        """Embedding and LM head cut by vocabulary rows (replicated when N does not divide the vocabulary)."""
        return {"embed_tokens.weight": Split(0), "lm_head.weight": Split(0)} if self.vocab_parallel else {}

    @property
    def rope(self) -> RotaryEmbedding:
        """The full-attention layers' rotary embedding."""
        return self.ropes["full_attention"]

    def rope_of(self, index: int) -> RotaryEmbedding:
        """Layer ``index``'s rotary embedding (sliding-window layers may have their own)."""
        return self.ropes.get(self.config.layer_types[index], self.rope)

    def to_device(self, device: torch.device | str, dtype: torch.dtype) -> "HybridModel":
        """Move weights; rotary frequencies stay fp32 on the same device."""
        self.to(device=device, dtype=dtype)
        self.ropes = _ropes(self.config, device)
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [N] -> the residual stream's first rows [N, hidden]."""
        x = self._embed_shard(token_ids) if self.vocab_parallel else self.embed_tokens(token_ids)
        return x * self.config.embedding_multiplier if self.config.embedding_multiplier != 1 else x

    def _embed_shard(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the tokens in this rank's vocabulary shard, zeros for the others, summed over ranks."""
        first = self.tp.rank * self.embed_tokens.num_embeddings
        local = token_ids - first
        outside = (local < 0) | (local >= self.embed_tokens.num_embeddings)
        rows = self.embed_tokens(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return all_reduce(rows, self.tp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32 (every rank's vocabulary shard gathered)."""
        logits = all_gather_last(self.lm_head(self.norm(hidden)).float(), self.tp)
        return logits / self.config.logits_scaling if self.config.logits_scaling != 1 else logits

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype
