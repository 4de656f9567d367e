"""Qwen3-Next and Qwen3.5 (``qwen3_next``, ``qwen3_5_text``, ``qwen3_5_moe_text``, and the multimodal
wrappers ``qwen3_5`` / ``qwen3_5_moe``, whose vision tower is ignored): Gated DeltaNet and gated
attention; and ``hypic_hybrid``, our own type on the same fields with another linear family (gla,
scalar_rope)."""
from typing import Any

from ...config import ModelConfig, RopeConfig, eos_ids, parse_layer_types
from ...errors import UnsupportedModel, as_written
from ..families import linear_family, native_families
from .base import Architecture


def qwen_rope(text: dict[str, Any]) -> RopeConfig:
    """Qwen's rotary embedding (default or linear scaling; partial rotary 0.25 unless said)."""
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise UnsupportedModel(f"rope_type {as_written(rope_type)} is not supported (default, linear)")
    return RopeConfig(
        theta=float(params.get("rope_theta", text.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
    )


def qwen_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """Qwen3-Next / Qwen3.5 fields (and ``hypic_hybrid``'s, which add ``linear_family``)."""
    heads = int(text["num_attention_heads"])
    return ModelConfig(
        model_type=text["model_type"], vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]), layer_types=parse_layer_types(text),
        num_attention_heads=heads, num_key_value_heads=int(text["num_key_value_heads"]),
        head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        linear_num_key_heads=int(text["linear_num_key_heads"]),
        linear_num_value_heads=int(text["linear_num_value_heads"]),
        linear_key_head_dim=int(text["linear_key_head_dim"]), linear_value_head_dim=int(text["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope=qwen_rope(text),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        num_experts=int(text.get("num_experts") or 0), num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
        attention_bias=bool(text.get("attention_bias", False)), eos_token_ids=eos_ids(text.get("eos_token_id")),
        linear_family=_native_family(text), raw=raw,
    )


def _native_family(text: dict[str, Any]) -> str:
    """The linear family of a ``hypic_hybrid`` config (Qwen3.5's fields plus ``linear_family``), one
    whose record allows it and whose check its fields pass. Other model types are Gated DeltaNet."""
    if text["model_type"] != "hypic_hybrid":
        return "gated_delta"
    name, natives = text.get("linear_family", "gated_delta"), native_families()
    if name not in natives:
        raise UnsupportedModel(f"hypic_hybrid linear_family {as_written(name)}: one of {', '.join(natives)}")
    check = linear_family(name).native
    assert check is not None
    check(text)
    return name


def study(hidden: int, layers: int) -> dict[str, Any]:
    """The scaling study's model: 8 Gated DeltaNet value heads of 64 x 64, a full layer every fourth."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=512, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4)


TINY: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
QWEN3_NEXT = Architecture(("qwen3_next",), qwen_config, TINY, reference=("Qwen3NextConfig", "Qwen3NextForCausalLM"))
QWEN3_5 = Architecture(("qwen3_5_text",), qwen_config, TINY, wraps=("qwen3_5",), study=study,
                       reference=("models.qwen3_5.Qwen3_5TextConfig", "models.qwen3_5.Qwen3_5ForCausalLM"))
QWEN3_5_MOE = Architecture(("qwen3_5_moe_text",), qwen_config, TINY, wraps=("qwen3_5_moe",),
                           reference=("models.qwen3_5_moe.Qwen3_5MoeTextConfig", "models.qwen3_5_moe.Qwen3_5MoeForCausalLM"))
NATIVE = Architecture(("hypic_hybrid",), qwen_config, TINY)  # no transformers class: its checkpoints are ours
