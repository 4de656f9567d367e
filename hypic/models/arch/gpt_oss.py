"""gpt-oss (``gpt_oss``): sliding-window and full attention with sinks and YaRN, a softmax-routed MoE
of clamped SwiGLU experts."""
from typing import Any

from ...config import (
    ATTENTION_KINDS, ModelConfig, SlidingWindow, eos_ids, first_set, parse_layer_types, rope_from_params)
from .base import Architecture


def gpt_oss_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """gpt-oss (``gpt_oss``): alternating sliding-window and full attention (q/k/v/o biases, a learned
    sink logit per head in every layer, YaRN rope), a softmax-routed MoE in every layer whose experts
    use a clamped SwiGLU with biases; norms multiply their weight in fp32."""
    heads, hidden, layers = int(text["num_attention_heads"]), int(text["hidden_size"]), int(text["num_hidden_layers"])
    types = text.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    size = int(text["intermediate_size"])
    return ModelConfig(
        model_type="gpt_oss", vocab_size=int(text["vocab_size"]), hidden_size=hidden, num_hidden_layers=layers,
        layer_types=parse_layer_types({**text, "layer_types": types}, ATTENTION_KINDS), num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads), head_dim=int(text.get("head_dim") or hidden // heads),
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=1, intermediate_size=size,
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope=rope_from_params(params, float(text.get("rope_theta", 150000.0))),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        num_experts=int(first_set(text, ("num_local_experts", "num_experts"), 0)),
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0), moe_intermediate_size=size, norm_topk_prob=True,
        attention_bias=bool(text.get("attention_bias", True)), eos_token_ids=eos_ids(text.get("eos_token_id")),
        attention_output_gate=False, rms_norm_unit_offset=False, norm_weight_in_fp32=True,
        sliding_window=SlidingWindow(int(text["sliding_window"])), attention_sinks=ATTENTION_KINDS,
        swiglu_clamp=(float(text.get("swiglu_alpha", 1.702)), float(text.get("swiglu_limit", 7.0))), expert_bias=True,
        raw=raw,
    )


TINY: dict[str, Any] = dict(  # sliding (window 8) / full alternating, sinks everywhere, YaRN, 4 experts
    vocab_size=320, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=131072,
    pad_token_id=None,
)
ARCHITECTURE = Architecture(("gpt_oss",), gpt_oss_config, TINY, reference=("GptOssConfig", "GptOssForCausalLM"),
                            noisy_biases=True, fused_experts=True)
