"""MiniMax-Text-01 (``minimax``): Lightning attention, softmax attention, a routed MoE everywhere,
scaled post-norm residuals."""
from typing import Any

from ...config import ModelConfig, ResidualScales, RopeConfig, eos_ids, parse_layer_types
from ...errors import UnsupportedModel, as_written
from .base import Architecture, every_fourth_full


def _minimax_layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, or the original checkpoints' ``attn_type_list`` (0: lightning, 1: softmax)."""
    if text.get("layer_types") is None and text.get("attn_type_list") is not None:
        kinds = {0: "linear_attention", 1: "full_attention"}
        return parse_layer_types({**text, "layer_types": [kinds.get(int(t), str(t)) for t in text["attn_type_list"]]})
    if text.get("layer_types") is None:  # transformers' default: full attention first, then alternating
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(int(text["num_hidden_layers"]))]
        return parse_layer_types({**text, "layer_types": types})
    return parse_layer_types(text)


def minimax_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """MiniMax-Text-01 (``minimax``): Lightning attention layers (one state of head_dim x head_dim
    per attention head, no conv), plain softmax attention with full rotary, a routed MoE in every
    layer, post-norm residuals scaled by the config's alpha / beta factors."""
    if text.get("sliding_window") is not None:
        raise UnsupportedModel("minimax with sliding_window is not supported (sliding-window hybrids are not served yet)")
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"minimax with hidden_act {as_written(text['hidden_act'])} is not supported (silu)")
    heads, hidden = int(text["num_attention_heads"]), int(text["hidden_size"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    factor = lambda name: float(text.get(name, 1))  # noqa: E731
    params = dict(text.get("rope_parameters") or {})
    return ModelConfig(
        model_type="minimax", vocab_size=int(text["vocab_size"]), hidden_size=hidden,
        num_hidden_layers=int(text["num_hidden_layers"]), layer_types=_minimax_layer_types(text),
        num_attention_heads=heads, num_key_value_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
        linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=1, intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096 * 32)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        rope=RopeConfig(theta=float(params.get("rope_theta", text.get("rope_theta", 1e6))), partial_rotary_factor=1.0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        num_experts=int(text["num_local_experts"]), num_experts_per_tok=int(text["num_experts_per_tok"]),
        moe_intermediate_size=int(text["intermediate_size"]), norm_topk_prob=True,
        eos_token_ids=eos_ids(text.get("eos_token_id")), linear_family="lightning", attention_output_gate=False,
        rms_norm_unit_offset=False,
        residual_scales=ResidualScales((factor("linear_attn_alpha_factor"), factor("linear_attn_beta_factor")),
                                       (factor("full_attn_alpha_factor"), factor("full_attn_beta_factor")),
                                       (factor("mlp_alpha_factor"), factor("mlp_beta_factor"))),
        raw=raw,
    )


def study(hidden: int, layers: int) -> dict[str, Any]:
    """The scaling study's widths with MiniMax's layers: Lightning heads = attention heads (4 of 64)."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2, block_size=64,
                layer_types=every_fourth_full(layers))


TINY: dict[str, Any] = dict(  # Lightning attention every other layer, 4 routed experts, blocks of 16 tokens
    vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=16,
    max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
)
ARCHITECTURE = Architecture(("minimax",), minimax_config, TINY, reference=("MiniMaxConfig", "MiniMaxForCausalLM"), study=study)
