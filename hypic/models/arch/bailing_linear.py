"""Ring-linear-2.0 (``bailing_moe_linear``: inclusionAI's Ring-mini-linear-2.0, Ring-flash-linear-2.0):
Lightning attention with RoPE inside its state (our scalar_rope family in Ring's form), GQA softmax
attention with q/k norms at the last of every ``layer_group_size`` layers, DeepSeek-V3-routed experts
with shared experts (dense MLPs in the first layers). Its checkpoints keep every layer's mixer under
``attention`` with fused ``query_key_value`` projections."""
import re
from typing import Any

from ...config import ModelConfig, RingLinear, RopeConfig, eos_ids, parse_layer_types
from ...errors import UnsupportedModel, as_written
from ...loading.tensor_sources import Direct, RowSlice, Source
from .base import Architecture
from .kimi import deepseek_experts

LAYER_KEY = re.compile(r"^layers\.(\d+)\.attention\.([^.]+)\.(.+)$")
LINEAR_NAMES = {"query_key_value": "qkv_proj", "g_proj": "output_gate", "g_norm": "norm", "dense": "out_proj",
                "query_layernorm": "q_norm", "key_layernorm": "k_norm"}  # Ring's linear layer -> our scalar_rope mixer
SOFTMAX_NAMES = {"dense": "o_proj", "query_layernorm": "q_norm", "key_layernorm": "k_norm"}  # query_key_value: split
REQUIRED = {"use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "linear_silu": False,
            "use_linear_silu": False, "linear_rope": True, "moe_router_enable_expert_bias": True}


def ring_name(config: ModelConfig, short: str) -> str:
    """Our name of a checkpoint tensor (the ``model.`` prefix already stripped): a linear layer's
    ``attention.*`` become the scalar_rope mixer's, a softmax layer's ``self_attn.*``; layers past the
    stack (multi-token prediction) are set apart, read by nothing."""
    short = re.sub(r"^word_embeddings\.", "embed_tokens.", short)
    short = re.sub(r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias", short)
    index = re.match(r"^layers\.(\d+)\.", short)
    if index is not None and int(index.group(1)) >= config.num_hidden_layers:
        return f"mtp.{short}"
    match = LAYER_KEY.match(short)
    if match is None:
        return short
    layer, module, rest = int(match.group(1)), match.group(2), match.group(3)
    if config.layer_types[layer] == "linear_attention":
        return f"layers.{layer}.linear_attn.{LINEAR_NAMES.get(module, module)}.{rest}"
    return f"layers.{layer}.self_attn.{SOFTMAX_NAMES.get(module, module)}.{rest}"


def split_attention_qkv(config: ModelConfig, sources: dict[str, Source]) -> dict[str, Source]:
    """A softmax layer's fused ``query_key_value`` rows [Q (H D) | K (Hkv D) | V (Hkv D)] as our q, k, v."""
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    ends = (q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows)
    bounds = {"q_proj": (0, ends[0]), "k_proj": (ends[0], ends[1]), "v_proj": (ends[1], ends[2])}
    out = dict(sources)
    for name, source in sources.items():
        if name.endswith(".mixer.query_key_value.weight") and isinstance(source, Direct):
            del out[name]
            prefix = name.removesuffix("query_key_value.weight")
            out.update({f"{prefix}{part}.weight": RowSlice(source.key, lo, hi) for part, (lo, hi) in bounds.items()})
    return out


def _layer_types(text: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Softmax attention at the last layer of every ``layer_group_size`` and at the layers left over
    after the last whole group (the vendor's rule; SGLang requires whole groups)."""
    group = int(text.get("layer_group_size", 1))
    whole = layers // group * group
    types = ["full_attention" if (i + 1) % group == 0 or i >= whole else "linear_attention" for i in range(layers)]
    return parse_layer_types({**text, "layer_types": types})


def _rope(text: dict[str, Any]) -> RopeConfig:
    """RoPE on the first ``partial_rotary_factor`` of each head (rotate-half pairs), in both kinds of
    layer; a scaled RoPE (YaRN) is refused: the linear states turn by plain rotations."""
    if text.get("rope_scaling"):
        raise UnsupportedModel(f"bailing_moe_linear with rope_scaling {as_written(text['rope_scaling'])} is not supported "
                               "(plain RoPE only)")
    return RopeConfig(theta=float(text.get("rope_theta", 600000.0)),
                      partial_rotary_factor=float(text.get("partial_rotary_factor", 1.0)))


def _check(text: dict[str, Any], head_dim: int) -> None:
    """Refuse what Ring-linear's published configs never set and HYPIC does not model."""
    for name, value in REQUIRED.items():
        if name in text and bool(text[name]) != value:
            raise UnsupportedModel(f"bailing_moe_linear with {name} {as_written(text[name])} is not supported ({value})")
    if text.get("hidden_act", "silu") != "silu" or text.get("score_function", "sigmoid") != "sigmoid":
        raise UnsupportedModel("bailing_moe_linear needs hidden_act silu and the sigmoid router (score_function)")
    groups, width = int(text.get("group_norm_size", 1)), int(text["num_attention_heads"]) * head_dim
    if width % groups:
        raise UnsupportedModel(f"bailing_moe_linear: group_norm_size {groups} does not divide the heads' "
                               f"{width} channels")


def _experts(text: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's MoE fields; shared experts of ``moe_shared_expert_intermediate_size`` each when set;
    a single expert is a dense MLP (as SGLang reads it)."""
    fields = deepseek_experts(text)
    shared = int(text.get("moe_shared_expert_intermediate_size") or fields["moe_intermediate_size"])
    fields["shared_expert_intermediate_size"] = shared * int(text.get("num_shared_experts") or 0)
    if fields["num_experts"] <= 1:
        fields["num_experts"] = 0
    return fields


def bailing_linear_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """Ring-linear: Lightning heads as many and as wide as the attention's query heads (``head_dim``),
    one K x V state each, no conv; GQA softmax layers; plain RMSNorm."""
    heads, layers, hidden = int(text["num_attention_heads"]), int(text["num_hidden_layers"]), int(text["hidden_size"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    _check(text, head_dim)
    return ModelConfig(
        model_type="bailing_moe_linear", vocab_size=int(text["vocab_size"]), hidden_size=hidden,
        num_hidden_layers=layers, layer_types=_layer_types(text, layers), num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads), head_dim=head_dim,
        linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, linear_conv_kernel_dim=1, intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope=_rope(text),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        mlp_only_layers=tuple(range(min(layers, int(text.get("first_k_dense_replace", 1))))),
        eos_token_ids=eos_ids(text.get("eos_token_id")), linear_family="scalar_rope", attention_output_gate=False,
        attention_qk_norm=True, rms_norm_unit_offset=False,
        ring_linear=RingLinear(norm_groups=int(text.get("group_norm_size", 1))), raw=raw, **_experts(text),
    )


# Lightning at layers 0 and 2, softmax at 1 and 3; 4 experts in 2 groups; output norm groups of 2 heads
TINY: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, num_hidden_layers=4, layer_group_size=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, group_norm_size=2, num_experts=4,
    num_experts_per_tok=2, num_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, score_function="sigmoid", moe_router_enable_expert_bias=True, first_k_dense_replace=1,
    use_qk_norm=True, use_qkv_bias=False, use_bias=False, linear_silu=False, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
    num_nextn_predict_layers=0, eos_token_id=256, pad_token_id=256,
)
ARCHITECTURE = Architecture(("bailing_moe_linear",), bailing_linear_config, TINY, rename=ring_name,
                            sources=split_attention_qkv)
