"""MiMo-V2-Flash (``mimo_v2_flash``): sliding-window attention with sinks and a full layer every sixth,
narrow values, sigmoid-routed experts."""
from typing import Any

from ...config import (
    ATTENTION_KINDS, GroupedSigmoidRouting, ModelConfig, RopeConfig, SlidingWindow, eos_ids, first_set,
    parse_layer_types, rope_from_params)
from ...errors import UnsupportedModel, as_written
from .base import Architecture


def _mimo_rope(text: dict[str, Any], kind: str) -> RopeConfig:
    defaults = {"full_attention": 5e6, "sliding_attention": 1e4}
    params = dict((text.get("rope_parameters") or {}).get(kind) or {})
    return rope_from_params(params, defaults[kind], 0.334)


def mimo_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """MiMo-V2-Flash (``mimo_v2_flash``): sliding-window attention (twice the KV heads, sink logits,
    its own rope theta) with a full-attention layer first and every sixth; keys 192 wide (64 rotated),
    values 128 wide and scaled by 0.707; DeepSeek-V3 sigmoid routing without shared experts, dense
    MLP in the first layer."""
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"mimo_v2_flash with hidden_act {as_written(text['hidden_act'])} is not supported (silu)")
    heads, hidden, layers = int(text["num_attention_heads"]), int(text["hidden_size"]), int(text["num_hidden_layers"])
    types = text.get("layer_types") or ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                        for i in range(layers)]
    window = int(text["sliding_window_size"]) + 1 if text.get("sliding_window_size") is not None else int(text["sliding_window"])
    kv_heads = int(text["num_key_value_heads"])
    dense = text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    scale = text.get("attention_value_scale", 0.707)
    return ModelConfig(
        model_type="mimo_v2_flash", vocab_size=int(text["vocab_size"]), hidden_size=hidden, num_hidden_layers=layers,
        layer_types=parse_layer_types({**text, "layer_types": types}, ATTENTION_KINDS), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=int(text.get("head_dim") or hidden // heads),
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=1, intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope=_mimo_rope(text, "full_attention"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        num_experts=int(first_set(text, ("n_routed_experts", "num_local_experts"), 0)),
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        mlp_only_layers=tuple(i for i, kind in enumerate(dense) if kind == "dense"),
        attention_bias=bool(text.get("attention_bias", False)), eos_token_ids=eos_ids(text.get("eos_token_id")),
        attention_output_gate=False, rms_norm_unit_offset=False, shared_expert_gated=False,
        routing=GroupedSigmoidRouting(int(text.get("n_group") or 1), int(text.get("topk_group") or 1),
                                      float(text.get("routed_scaling_factor") or 1.0)),
        sliding_window=SlidingWindow(window, 2 * kv_heads, _mimo_rope(text, "sliding_attention")),
        attention_sinks=("sliding_attention",), value_head_dim=int(text.get("v_head_dim") or text.get("head_dim")),
        value_scale=1.0 if scale is None else float(scale), output_bias=False, raw=raw,
    )


def study(hidden: int, layers: int) -> dict[str, Any]:
    """MiMo-V2-Flash's mix: window 129 (twice the KV heads), a full layer first and every sixth, dense MLPs."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=512, moe_intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=1, head_dim=96, v_head_dim=64, n_routed_experts=4,
                num_experts_per_tok=2, sliding_window=129, pad_token_id=None, bos_token_id=None,
                layer_types=["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                             for i in range(layers)], mlp_layer_types=["dense"] * layers)


TINY: dict[str, Any] = dict(  # full, sliding (window 8, 2 KV heads, sinks), sliding, full; K 24 wide, V 16
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    n_group=1, topk_group=1, sliding_window=8,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=4096, pad_token_id=None,
    bos_token_id=None,
)
ARCHITECTURE = Architecture(("mimo_v2_flash",), mimo_config, TINY, reference=("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM"),
                            noisy_biases=True, study=study)
