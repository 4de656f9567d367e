"""Nemotron-H (``nemotron_h``): single-sublayer blocks (Mamba2, attention, squared-ReLU MLP, routed
MoE) grouped into our layers."""
import re
from typing import Any

from ...config import (
    BlockLayout, GroupedSigmoidRouting, Mamba2Options, ModelConfig, RopeConfig, eos_ids, first_set, json_float)
from ...errors import UnsupportedModel, as_written
from .base import Architecture, every_fourth_full


NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
NEMOTRON_MIXERS = ("linear_attention", "full_attention")


def nemotron_layout(kinds: list[str]) -> BlockLayout:
    """Group blocks into layers: each mixer block, with the feed-forward block right after it if any.
    A feed-forward block with no mixer before it has no layer of ours to join: refused."""
    mixers, ffns, ffn_kinds = [], [], []
    for index, kind in enumerate(kinds):
        if kind in NEMOTRON_MIXERS:
            mixers.append(index)
            ffns.append(None)
            ffn_kinds.append(None)
        elif kind in ("mlp", "moe") and mixers and ffns[-1] is None:  # the block before was a mixer
            ffns[-1], ffn_kinds[-1] = index, kind
        else:
            raise UnsupportedModel(f"nemotron_h block {index} ({as_written(kind)}) does not follow a Mamba2 or attention block: "
                                   "HYPIC serves patterns where every MLP / MoE block follows a mixer block")
    return BlockLayout(tuple(mixers), tuple(ffns), tuple(ffn_kinds))


def nemotron_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """Nemotron-H (``nemotron_h``): Mamba2 blocks (as Granite-4.0-H's), attention blocks without RoPE,
    squared-ReLU MLP blocks and DeepSeek-V3-routed MoE blocks of squared-ReLU experts, one sublayer per
    block (``BlockLayout`` groups them into our layers)."""
    kinds = text.get("layers_block_type") or text.get("layer_types")
    if kinds is None and text.get("hybrid_override_pattern"):
        kinds = [NEMOTRON_PATTERN.get(ch, ch) for ch in text["hybrid_override_pattern"]]
    if not kinds:
        raise UnsupportedModel("nemotron_h config names no layers_block_type / hybrid_override_pattern")
    for name, expected in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if text.get(name, expected) != expected:
            raise UnsupportedModel(f"nemotron_h with {name} {as_written(text[name])} is not supported ({expected})")
    if text.get("mlp_bias"):
        raise UnsupportedModel("nemotron_h with mlp_bias is not supported")
    if text.get("sliding_window") is not None:
        raise UnsupportedModel("nemotron_h with sliding_window is not supported (sliding-window hybrids are not served yet)")
    layout = nemotron_layout(list(kinds))
    hidden, heads, groups = int(text["hidden_size"]), int(text["mamba_num_heads"]), int(text.get("n_groups", 8))
    if heads % groups:
        raise UnsupportedModel("nemotron_h: mamba_num_heads must split evenly into n_groups")
    attention_heads = int(text["num_attention_heads"])
    limit = tuple(json_float(v) for v in (text.get("time_step_limit") or (0.0, float("inf"))))
    experts = int(first_set(text, ("n_routed_experts", "num_local_experts"), 0))
    return ModelConfig(
        model_type="nemotron_h", vocab_size=int(text["vocab_size"]), hidden_size=hidden,
        num_hidden_layers=len(layout.mixer_blocks), layer_types=tuple(kinds[i] for i in layout.mixer_blocks),
        num_attention_heads=attention_heads, num_key_value_heads=int(text.get("num_key_value_heads") or attention_heads),
        head_dim=int(text.get("head_dim") or hidden // attention_heads), linear_num_key_heads=groups,
        linear_num_value_heads=heads, linear_key_head_dim=int(text["ssm_state_size"]),
        linear_value_head_dim=int(text["mamba_head_dim"]), linear_conv_kernel_dim=int(text.get("conv_kernel", 4)),
        intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(text.get("layer_norm_epsilon", 1e-5)), rope=RopeConfig(partial_rotary_factor=0.0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)), num_experts=experts,
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(text.get("moe_shared_expert_intermediate_size") or 0)
        * int(text.get("n_shared_experts", 1)),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)), eos_token_ids=eos_ids(text.get("eos_token_id")),
        linear_family="mamba2", attention_output_gate=False, rms_norm_unit_offset=False, norm_weight_in_fp32=True,
        shared_expert_gated=False, mamba=Mamba2Options(bool(text.get("use_conv_bias", True)), bool(text.get("use_bias", False)), (limit[0], limit[1])),
        routing=GroupedSigmoidRouting(int(text.get("n_group", 1)), int(text.get("topk_group", 1)),
                                      float(text.get("routed_scaling_factor", 1.0))),
        blocks=layout, mlp_activation="relu2", moe_latent_size=text.get("moe_latent_size"), raw=raw,
    )


BLOCK_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")  # a checkpoint tensor of block b (before the loader groups layers)
NEMOTRON_NAMES = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}
NEMOTRON_GROUPS = {"linear_attention": "mamba", "full_attention": "self_attn"}


def block_name(config: ModelConfig, short: str) -> str:
    """Nemotron-H's name of a tensor in ours: block b's ``norm`` / ``mixer`` become its layer's input
    norm and token mixer, or post-attention norm and MLP (``config.blocks`` says which)."""
    match = BLOCK_KEY.match(short)
    if config.blocks is None or not match:
        return short if config.blocks is None else NEMOTRON_NAMES.get(short, short)
    block, rest = int(match.group(1)), match.group(2)
    layout = config.blocks
    if block in layout.mixer_blocks:
        layer = layout.mixer_blocks.index(block)
        norm, group = "input_layernorm", NEMOTRON_GROUPS[config.layer_types[layer]]
    elif block in layout.ffn_blocks:
        layer, norm, group = layout.ffn_blocks.index(block), "post_attention_layernorm", "mlp"
    else:
        return short
    return f"layers.{layer}.{norm}.weight" if rest == "norm.weight" else f"layers.{layer}.{group}.{rest.removeprefix('mixer.')}"



def study(hidden: int, layers: int) -> dict[str, Any]:
    """Mamba2 as Granite's study model (8 heads of 64 x 64, width 2 x hidden), each mixer block followed
    by a squared-ReLU MLP block."""
    return dict(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, mamba_num_heads=8, mamba_head_dim=2 * hidden // 8,
                ssm_state_size=64, n_groups=4, conv_kernel=4, n_routed_experts=0, chunk_size=64, pad_token_id=None,
                bos_token_id=None,
                layers_block_type=[block for kind in every_fourth_full(layers) for block in (kind, "mlp")])


TINY: dict[str, Any] = dict(  # Mamba2 + MoE, attention (no RoPE), MLP, two Mamba2 in a row, Mamba2 + MoE
    vocab_size=320, hidden_size=64, layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                                                       "linear_attention", "linear_attention", "moe"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=4,
    mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
    routed_scaling_factor=2.0, chunk_size=16, max_position_embeddings=4096, pad_token_id=None, bos_token_id=None,
)
ARCHITECTURE = Architecture(("nemotron_h",), nemotron_config, TINY, reference=("NemotronHConfig", "NemotronHForCausalLM"),
                            rename=block_name, study=study)
