"""The reference's own reading of an HF checkpoint directory: config fields and fp32 tensors.

Written from the published Qwen3-Next / Qwen3.5 and MiniMax layouts, sharing no code with ``hypic.loader``
or ``hypic.config``: the reference must not inherit a bug from the runtime it checks.
"""
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

WRAPPERS = ("qwen3_5", "qwen3_5_moe")
PREFIXES = ("model.language_model.", "model.", "backbone.")  # backbone: Nemotron-H


@dataclass(frozen=True)
class RefConfig:
    """The config fields the reference forward reads."""

    model_type: str
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    key_heads: int  # linear layers
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float
    rope_theta: float
    rotary_dim: int
    rope_scale: float  # positions are divided by it ("linear" rope scaling)
    experts: int
    top_k: int
    norm_topk: bool
    sparse_step: int
    mlp_only: tuple[int, ...]
    lightning: bool = False  # MiniMax: Lightning linear layers, plain attention and norms, scaled post-norm residuals
    scales: dict[str, float] | None = None  # MiniMax's residual factors by config name
    granite: dict[str, float] | None = None  # Granite: Mamba2 layers, multipliers, ungated shared MLP
    family: str = "gated_delta"  # hypic_hybrid: gla or scalar_rope linear layers, our own parameter names
    linear_rotary_dim: int = 0  # scalar_rope: key channels rotated inside the linear state
    kimi: dict | None = None  # Kimi-Linear: KDA layers, latent attention without RoPE, sigmoid-routed experts
    value_head_dim: int = 0  # width of an attention value head when it differs from head_dim (latent attention)
    dt_limit: tuple[float, float] = (0.0, float("inf"))  # Mamba2's clamp of dt after softplus
    nemotron_blocks: tuple[str, ...] = ()  # Nemotron-H: one sublayer per block, by kind (mixers are layer_types)
    routing: dict | None = None  # DeepSeek-V3's sigmoid router: groups, top_groups, scaling (Kimi, Nemotron-H)

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.mlp_only and (layer + 1) % self.sparse_step == 0


def _text_fields(raw: dict) -> dict:
    return raw["text_config"] if raw["model_type"] in WRAPPERS else raw


def _minimax_config(raw: dict) -> RefConfig:
    """MiniMax: a Lightning layer has one head_dim x head_dim state per attention head, no conv."""
    heads, head_dim = raw["num_attention_heads"], raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    names = [f"{kind}_{part}_factor" for kind in ("full_attn", "linear_attn", "mlp") for part in ("alpha", "beta")]
    return RefConfig(
        model_type="minimax", layer_types=tuple(raw["layer_types"]), heads=heads, kv_heads=raw["num_key_value_heads"],
        head_dim=head_dim, key_heads=heads, value_heads=heads, key_dim=head_dim, value_dim=head_dim, conv_kernel=1,
        eps=raw["rms_norm_eps"], rope_theta=rope.get("rope_theta", 1e6), rotary_dim=head_dim, rope_scale=1.0,
        experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"], norm_topk=True, sparse_step=1, mlp_only=(),
        lightning=True, scales={name: float(raw.get(name, 1)) for name in names},
    )


def _granite_config(raw: dict) -> RefConfig:
    """Granite-4.0-H: a Mamba2 layer has a d_state x head_dim state per head; B and C per head group."""
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    kinds = {"mamba": "linear_attention", "attention": "full_attention"}
    rope = raw.get("rope_parameters") or {}
    limit = [float(v["__float__"]) if isinstance(v, dict) else float(v) for v in raw["time_step_limit"]]
    return RefConfig(
        model_type="granitemoehybrid", layer_types=tuple(kinds.get(t, t) for t in raw["layer_types"]), heads=heads,
        kv_heads=raw["num_key_value_heads"], head_dim=hidden // heads, key_heads=raw["mamba_n_groups"],
        value_heads=raw["mamba_n_heads"], key_dim=raw["mamba_d_state"], value_dim=raw["mamba_d_head"],
        conv_kernel=raw["mamba_d_conv"], eps=raw["rms_norm_eps"], rope_theta=rope.get("rope_theta", 10000.0),
        rotary_dim=hidden // heads if raw.get("position_embedding_type") == "rope" else 0, rope_scale=1.0,
        experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"], norm_topk=True, sparse_step=1, mlp_only=(),
        granite={"embedding": raw["embedding_multiplier"], "residual": raw["residual_multiplier"],
                 "attention": raw["attention_multiplier"], "logits": raw["logits_scaling"]},
        dt_limit=(limit[0], limit[1]),
    )


def _nemotron_config(raw: dict) -> RefConfig:
    """Nemotron-H: blocks of one sublayer each; Mamba2 mixers as Granite's, attention without RoPE."""
    blocks = tuple(raw["layers_block_type"])
    limit = [float(v["__float__"]) if isinstance(v, dict) else float(v) for v in raw["time_step_limit"]]
    return RefConfig(
        model_type="nemotron_h", layer_types=tuple(b for b in blocks if b.endswith("attention")),
        heads=raw["num_attention_heads"], kv_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        key_heads=raw["n_groups"], value_heads=raw["mamba_num_heads"], key_dim=raw["ssm_state_size"],
        value_dim=raw["mamba_head_dim"], conv_kernel=raw["conv_kernel"], eps=raw["layer_norm_epsilon"],
        rope_theta=1.0, rotary_dim=0, rope_scale=1.0, experts=raw["n_routed_experts"],
        top_k=raw["num_experts_per_tok"], norm_topk=raw["norm_topk_prob"], sparse_step=1, mlp_only=(),
        dt_limit=(limit[0], limit[1]), nemotron_blocks=blocks,
        routing={"groups": raw["n_group"], "top_groups": raw["topk_group"], "scaling": raw["routed_scaling_factor"]},
    )


def _kimi_config(raw: dict) -> RefConfig:
    """Kimi-Linear as transformers saves it: some MoE fields under their attribute-map names."""
    def pick(*names: str, default=None):
        return next((raw[n] for n in names if raw.get(n) is not None), default)

    heads, dim = raw["linear_attn_config"]["num_heads"], raw["linear_attn_config"]["head_dim"]
    dense = tuple(i for i, kind in enumerate(raw["mlp_layer_types"]) if kind == "dense")
    return RefConfig(
        model_type="kimi_linear", layer_types=tuple(raw["layer_types"]), heads=raw["num_attention_heads"],
        kv_heads=raw["num_attention_heads"], head_dim=raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"],
        key_heads=heads, value_heads=heads, key_dim=dim, value_dim=dim,
        conv_kernel=raw["linear_attn_config"]["short_conv_kernel_size"], eps=raw["rms_norm_eps"], rope_theta=1.0,
        rotary_dim=0, rope_scale=1.0, experts=pick("num_experts", "num_local_experts", default=0),
        top_k=pick("num_experts_per_token", "num_experts_per_tok"), norm_topk=pick("moe_renormalize", "norm_topk_prob"),
        sparse_step=1, mlp_only=dense, value_head_dim=raw["v_head_dim"],
        kimi={"kv_lora_rank": raw["kv_lora_rank"], "nope": raw["qk_nope_head_dim"], "rope": raw["qk_rope_head_dim"],
              "value": raw["v_head_dim"]},
        routing={"groups": pick("num_expert_group", "n_group"), "top_groups": raw["topk_group"],
                 "scaling": raw["routed_scaling_factor"]},
    )


def read_config(path: Path) -> RefConfig:
    """Parse ``config.json`` (the multimodal wrappers' ``text_config`` for those)."""
    raw = _text_fields(json.loads((path / "config.json").read_text()))
    if raw["model_type"] == "hypic_hybrid":
        qwen = read_config_fields({**raw, "model_type": "qwen3_5_text"})
        partial = (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
        return dataclasses.replace(qwen, model_type="hypic_hybrid", family=raw["linear_family"],
                                   linear_rotary_dim=int(raw["linear_value_head_dim"] * partial))
    if raw["model_type"] == "minimax":
        return _minimax_config(raw)
    if raw["model_type"] == "granitemoehybrid":
        return _granite_config(raw)
    if raw["model_type"] == "kimi_linear":
        return _kimi_config(raw)
    if raw["model_type"] == "nemotron_h":
        return _nemotron_config(raw)
    return read_config_fields(raw)


def read_config_fields(raw: dict) -> RefConfig:
    """The Qwen3-Next / Qwen3.5 fields of a config dict."""
    rope = raw.get("rope_parameters") or {}
    layers = raw["num_hidden_layers"]
    interval = raw.get("full_attention_interval", 4)
    types = raw.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                        for i in range(layers)]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return RefConfig(
        model_type=raw["model_type"], layer_types=tuple(types), heads=raw["num_attention_heads"],
        kv_heads=raw["num_key_value_heads"], head_dim=head_dim, key_heads=raw["linear_num_key_heads"],
        value_heads=raw["linear_num_value_heads"], key_dim=raw["linear_key_head_dim"],
        value_dim=raw["linear_value_head_dim"], conv_kernel=raw["linear_conv_kernel_dim"], eps=raw["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)), rotary_dim=int(head_dim * partial),
        rope_scale=rope.get("factor", 1.0) if rope.get("rope_type") == "linear" else 1.0,
        experts=raw.get("num_experts") or 0, top_k=raw.get("num_experts_per_tok") or 0,
        norm_topk=raw.get("norm_topk_prob", True), sparse_step=raw.get("decoder_sparse_step") or 1,
        mlp_only=tuple(raw.get("mlp_only_layers") or ()),
    )


def _short_name(key: str) -> str | None:
    """Drop the text-model prefix; None for tensors the text model does not use (vision, MTP)."""
    if key.startswith(("model.visual.", "visual.", "mtp.")):
        return None
    for prefix in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every text-model tensor in fp32, keyed like ``layers.0.linear_attn.A_log``."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                name = _short_name(key)
                if name is not None:
                    tensors[name] = handle.get_tensor(key).float()
    if "lm_head.weight" not in tensors:  # tied embeddings
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return tensors
