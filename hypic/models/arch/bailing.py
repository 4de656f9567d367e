"""Bailing-hybrid (``bailing_hybrid``, inclusionAI's Ling / Ring hybrid models): Kimi Delta Attention with
full-rank gates and a bounded decay, multi-head latent attention with interleaved RoPE and a sigmoid
gate per head, DeepSeek-V3-routed experts (dense MLPs in the first layers)."""
import re
from typing import Any

from ...config import KDAGates, LatentAttention, ModelConfig, RopeConfig, eos_ids, first_set, parse_layer_types
from ...errors import UnsupportedModel, as_written
from .base import Architecture
from .kimi import deepseek_experts

RENAMES = (  # the checkpoint's names (as Ling ships them, or as transformers holds them) -> ours
    (re.compile(r"^word_embeddings\."), "embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.self_attn\.conv1d\.weight$"), ".self_attn.conv_weight"),  # transformers' packed [q | k | v] conv
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)


def bailing_name(config: ModelConfig, short: str) -> str:
    """Our name of a checkpoint tensor (the text-model prefix already stripped)."""
    for pattern, replacement in RENAMES:
        short = pattern.sub(replacement, short)
    return short


def _layer_types(text: dict[str, Any], layers: int) -> tuple[str, ...]:
    """``layer_types``, else the last layer of every ``layer_group_size`` is full attention."""
    if text.get("layer_types") is not None:
        return parse_layer_types(text)
    group = int(text.get("layer_group_size", 6))
    types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(layers)]
    return parse_layer_types({**text, "layer_types": types})


def _dense_layers(text: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Layers with a dense MLP: ``mlp_layer_types`` "dense", else the first ``first_k_dense_replace``."""
    kinds = text.get("mlp_layer_types")
    if kinds is None:
        return tuple(range(min(layers, int(text.get("first_k_dense_replace", 2)))))
    return tuple(i for i, kind in enumerate(kinds) if kind == "dense")


def _rope(text: dict[str, Any], rope_dim: int) -> RopeConfig:
    """Plain RoPE on the rope channels, which end the cached head; scaled variants are refused."""
    params = dict(text.get("rope_parameters") or {})
    if params.get("rope_type", "default") != "default" or text.get("rope_scaling"):
        raise UnsupportedModel(f"bailing_hybrid with rope_type {as_written(params.get('rope_type'))} is not supported (default)")
    theta = float(params.get("rope_theta", text.get("rope_theta", 6_000_000.0)))
    return RopeConfig(theta=theta, rotary_dim=rope_dim, rotated_last=True)


def _latent(text: dict[str, Any]) -> LatentAttention:
    nope = int(text["qk_nope_head_dim"])
    return LatentAttention(int(text["kv_lora_rank"]), text.get("q_lora_rank"), nope, int(text["qk_rope_head_dim"]),
                           int(text.get("v_head_dim") or nope), rotary=True, interleaved=True, output_gate=True)


def bailing_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """Bailing-hybrid: KDA layers (heads and head size of the attention's ``num_attention_heads`` and
    ``head_dim``, as transformers derives them), MLA with rotated rope parts at the last of every
    ``layer_group_size`` layers, DeepSeek-V3's sigmoid router with an ungated shared expert, plain RMSNorm."""
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"bailing_hybrid with hidden_act {as_written(text['hidden_act'])} is not supported (silu)")
    heads, layers = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
    if int(text.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedModel("bailing_hybrid: latent attention gives every head its own keys (num_key_value_heads "
                               "must equal num_attention_heads)")
    latent = _latent(text)
    linear_heads = int(text.get("linear_num_heads") or heads)
    linear_dim = int(first_set(text, ("linear_head_dim", "head_dim"), 128))
    lower_bound = float(text.get("kda_lower_bound", -5.0)) if text.get("kda_safe_gate", True) else None
    return ModelConfig(  # the attention fields describe the cache: one latent head of kv_lora_rank + rope keys
        model_type="bailing_hybrid", vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
        num_hidden_layers=layers, layer_types=_layer_types(text, layers), num_attention_heads=heads,
        num_key_value_heads=1, head_dim=latent.kv_lora_rank + latent.rope_dim, linear_num_key_heads=linear_heads,
        linear_num_value_heads=linear_heads, linear_key_head_dim=linear_dim, linear_value_head_dim=linear_dim,
        linear_conv_kernel_dim=int(first_set(text, ("short_conv_kernel_size", "linear_conv_kernel_dim"), 4)),
        intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(first_set(text, ("model_max_length", "max_position_embeddings"), 1 << 18)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope=_rope(text, latent.rope_dim),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        mlp_only_layers=_dense_layers(text, layers), attention_bias=bool(text.get("attention_bias", False)),
        eos_token_ids=eos_ids(text.get("eos_token_id")), linear_family="kda", attention_output_gate=False,
        rms_norm_unit_offset=False, latent_attention=latent, kda_gates=KDAGates(full_rank=True, lower_bound=lower_bound),
        raw=raw, **deepseek_experts(text),
    )


TINY: dict[str, Any] = dict(  # KDA (4 heads of 16) at layers 1 and 3, MLA with a q latent at 2 and 4; 4 experts in 2 groups
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=16, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, num_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, layer_group_size=2, short_conv_kernel_size=4,
    rope_theta=10000.0, pad_token_id=None, bos_token_id=None, eos_token_id=256,
)
ARCHITECTURE = Architecture(("bailing_hybrid",), bailing_config, TINY, rename=bailing_name,
                            reference=("BailingHybridConfig", "BailingHybridForCausalLM"), keeps_decay=True)
