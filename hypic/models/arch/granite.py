"""Granite-4.0-H (``granitemoehybrid``): Mamba2 layers, attention with RoPE or none, routed plus shared
experts, Granite's multipliers."""
from typing import Any

from ...config import Mamba2Options, ModelConfig, RopeConfig, eos_ids, json_float, parse_layer_types
from ...errors import UnsupportedModel, as_written
from .base import Architecture, every_fourth_full


GRANITE_LAYER_KINDS = {"mamba": "linear_attention", "attention": "full_attention",
                       "linear_attention": "linear_attention", "full_attention": "full_attention"}


def granite_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """Granite-4.0-H (``granitemoehybrid``): Mamba2 layers (a state of d_state x head_dim per head, scalar
    decay exp(dt A), B and C shared by head groups, conv with bias, D skip, grouped gated norm),
    plain attention with RoPE or none, routed experts plus an ungated shared MLP (or the shared MLP
    alone), Granite's embedding, residual, attention and logits multipliers."""
    kinds = text.get("layer_types") or text.get("layers_block_type")
    if kinds is None or any(kind not in GRANITE_LAYER_KINDS for kind in kinds):
        raise UnsupportedModel(f"granitemoehybrid layer types {as_written(kinds)}: expected mamba / attention per layer")
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"granitemoehybrid with hidden_act {as_written(text['hidden_act'])} is not supported (silu)")
    hidden, heads, groups = int(text["hidden_size"]), int(text["mamba_n_heads"]), int(text["mamba_n_groups"])
    head_dim, experts = int(text["mamba_d_head"]), int(text.get("num_local_experts") or 0)
    if int(text.get("mamba_expand", 2) * hidden) != heads * head_dim or heads % groups:
        raise UnsupportedModel("granitemoehybrid: mamba_expand x hidden_size must equal mamba_n_heads x mamba_d_head, "
                               "and the heads must split evenly into mamba_n_groups")
    rope = dict(text.get("rope_parameters") or {})
    attention_heads = int(text["num_attention_heads"])
    limit = tuple(json_float(v) for v in (text.get("time_step_limit") or (0.0, float("inf"))))
    return ModelConfig(
        model_type="granitemoehybrid", vocab_size=int(text["vocab_size"]), hidden_size=hidden,
        num_hidden_layers=int(text["num_hidden_layers"]),
        layer_types=parse_layer_types({**text, "layer_types": [GRANITE_LAYER_KINDS[k] for k in kinds]}),
        num_attention_heads=attention_heads, num_key_value_heads=int(text.get("num_key_value_heads") or attention_heads),
        head_dim=int(text.get("head_dim") or hidden // attention_heads), linear_num_key_heads=groups,
        linear_num_value_heads=heads, linear_key_head_dim=int(text["mamba_d_state"]), linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=int(text.get("mamba_d_conv", 4)),
        intermediate_size=int(text["shared_intermediate_size"] if not experts else text["intermediate_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig(theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                        partial_rotary_factor=1.0 if text.get("position_embedding_type") == "rope" else 0.0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)), num_experts=experts,
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0), moe_intermediate_size=int(text["intermediate_size"]),
        shared_expert_intermediate_size=int(text["shared_intermediate_size"]), norm_topk_prob=True,
        attention_bias=bool(text.get("attention_bias", False)), eos_token_ids=eos_ids(text.get("eos_token_id")),
        linear_family="mamba2", attention_output_gate=False, rms_norm_unit_offset=False,
        residual_multiplier=float(text.get("residual_multiplier", 1.0)),
        embedding_multiplier=float(text.get("embedding_multiplier", 1.0)),
        logits_scaling=float(text.get("logits_scaling", 1.0)), attention_scale=float(text.get("attention_multiplier", 1.0)),
        shared_expert_gated=False,
        mamba=Mamba2Options(bool(text.get("mamba_conv_bias", True)), bool(text.get("mamba_proj_bias", False)),
                            (limit[0], limit[1])),
        raw=raw,
    )


def study(hidden: int, layers: int) -> dict[str, Any]:
    """Mamba2 with the study's state per head (64 x 64), 8 heads in 4 groups (their width: 2 x hidden),
    a dense MLP."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=512, shared_intermediate_size=512,
                num_local_experts=0, num_attention_heads=4, num_key_value_heads=1, mamba_n_heads=8,
                mamba_d_head=2 * hidden // 8, mamba_d_state=64, mamba_n_groups=4, mamba_d_conv=4, mamba_expand=2,
                mamba_chunk_size=64, position_embedding_type="rope", layer_types=every_fourth_full(layers))


TINY: dict[str, Any] = dict(  # Mamba2 layers (4 heads of 32 in 2 groups, state 16), routed + shared MLP
    vocab_size=320, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=4096, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
    layer_types=["mamba", "attention", "mamba", "mamba"],
)
ARCHITECTURE = Architecture(("granitemoehybrid",), granite_config, TINY,
                            reference=("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"), study=study)
