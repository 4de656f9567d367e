"""Kimi-Linear (``kimi_linear``): Kimi Delta Attention, latent attention without RoPE,
DeepSeek-V3-routed experts."""
from typing import Any

from ...config import (
    GroupedSigmoidRouting, LatentAttention, ModelConfig, RopeConfig, eos_ids, first_set, parse_layer_types)
from ...errors import UnsupportedModel, as_written
from .base import Architecture, every_fourth_full


def _kimi_layer_types(text: dict[str, Any], layers: int, linear: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, or the original ``linear_attn_config`` lists (1-indexed), or transformers' default."""
    if text.get("layer_types") is None and "full_attn_layers" in linear:
        full = {int(i) - 1 for i in linear["full_attn_layers"]}
        types = ["full_attention" if i in full else "linear_attention" for i in range(layers)]
        return parse_layer_types({**text, "layer_types": types})
    if text.get("layer_types") is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
        return parse_layer_types({**text, "layer_types": types})
    return parse_layer_types(text)


def _kimi_dense_layers(text: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Layers with a dense MLP: ``mlp_layer_types`` "dense", else the first ``first_k_dense_replace``."""
    kinds = text.get("mlp_layer_types")
    if kinds is None:
        return tuple(range(min(layers, int(text.get("first_k_dense_replace", 1)))))
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def kimi_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """Kimi-Linear (``kimi_linear``): Kimi Delta Attention layers (the delta rule with a decay per key
    channel: dense T_C), multi-head latent attention without RoPE, DeepSeek-V3's sigmoid-routed
    experts with an ungated shared expert (dense MLPs in the first layers), plain RMSNorm."""
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"kimi_linear with hidden_act {as_written(text['hidden_act'])} is not supported (silu)")
    heads, layers = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
    if int(text.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedModel("kimi_linear: latent attention gives every head its own keys (num_key_value_heads "
                               "must equal num_attention_heads)")
    linear = dict(text.get("linear_attn_config") or {})
    linear_heads = int(linear.get("num_heads", text.get("linear_num_heads", 32)))
    linear_dim = int(linear.get("head_dim", text.get("linear_head_dim", 128)))
    latent = LatentAttention(int(text["kv_lora_rank"]), text.get("q_lora_rank"), int(text["qk_nope_head_dim"]),
                             int(text["qk_rope_head_dim"]), int(text.get("v_head_dim") or text["qk_nope_head_dim"]))
    return ModelConfig(  # the attention fields describe the cache: one latent head of kv_lora_rank + rope keys
        model_type="kimi_linear", vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
        num_hidden_layers=layers, layer_types=_kimi_layer_types(text, layers, linear), num_attention_heads=heads,
        num_key_value_heads=1, head_dim=latent.kv_lora_rank + latent.rope_dim, linear_num_key_heads=linear_heads,
        linear_num_value_heads=linear_heads, linear_key_head_dim=linear_dim, linear_value_head_dim=linear_dim,
        linear_conv_kernel_dim=int(linear.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4))),
        intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(first_set(text, ("model_max_length", "max_position_embeddings"), 1 << 20)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope=RopeConfig(partial_rotary_factor=0.0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        mlp_only_layers=_kimi_dense_layers(text, layers), attention_bias=bool(text.get("attention_bias", False)),
        eos_token_ids=eos_ids(text.get("eos_token_id")), linear_family="kda", attention_output_gate=False,
        rms_norm_unit_offset=False, latent_attention=latent, raw=raw, **deepseek_experts(text),
    )


def deepseek_experts(text: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields of DeepSeek-V3's MoE (Kimi-Linear's, Bailing-hybrid's): routed experts under
    either name, ungated shared experts, the grouped sigmoid router."""
    expert_size = int(text["moe_intermediate_size"])
    return dict(
        num_experts=int(first_set(text, ("num_experts", "num_local_experts"), 0)),
        num_experts_per_tok=int(first_set(text, ("num_experts_per_token", "num_experts_per_tok"), 0)),
        moe_intermediate_size=expert_size,
        shared_expert_intermediate_size=expert_size * int(first_set(text, ("num_shared_experts", "n_shared_experts"), 0)),
        norm_topk_prob=bool(first_set(text, ("moe_renormalize", "norm_topk_prob"), True)), shared_expert_gated=False,
        routing=GroupedSigmoidRouting(int(first_set(text, ("num_expert_group", "n_group"), 1)),
                                      int(text.get("topk_group") or 1), float(text.get("routed_scaling_factor", 1.0))),
    )


def study(hidden: int, layers: int) -> dict[str, Any]:
    """KDA with 8 heads of 64 (the study's state), latent attention, dense MLPs."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=512, moe_intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=64,
                qk_rope_head_dim=32, v_head_dim=64, num_local_experts=4, num_experts_per_tok=2, pad_token_id=None,
                bos_token_id=None, eos_token_id=256,
                linear_attn_config={"head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 4},
                layer_types=every_fourth_full(layers), mlp_layer_types=["dense"] * layers)


TINY: dict[str, Any] = dict(  # KDA (4 heads of 16) at layers 1, 3, 4; latent attention at 2; 4 experts in 2 groups
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, pad_token_id=None, bos_token_id=None,
    eos_token_id=256,
    linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "full_attn_layers": [2],
                        "kda_layers": [1, 3, 4]},
)
ARCHITECTURE = Architecture(("kimi_linear",), kimi_config, TINY, reference=("KimiLinearConfig", "KimiLinearForCausalLM"), study=study)
