"""The reference's own reading of an HF checkpoint directory: config fields and fp32 tensors.

Written from the published Qwen3-Next / Qwen3.5, MiniMax, gpt-oss, MiMo-V2-Flash, Ling (Bailing) and Ring-linear layouts, sharing no code
with ``hypic.loading.loader`` or ``hypic.config``: the reference must not inherit a bug from the runtime it checks.
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
    routing: dict | None = None  # DeepSeek-V3's sigmoid router: groups, top_groups, scaling (Kimi, Nemotron-H, MiMo)
    window: int = 0  # sliding_attention layers: query i sees keys j with i - window < j <= i (gpt-oss, MiMo-V2-Flash)
    sliding_kv_heads: int = 0  # KV heads of the sliding layers where they differ from kv_heads (MiMo-V2-Flash)
    rope_by_kind: dict[str, tuple[float, int]] | None = None  # (theta, rotary_dim) per layer kind (MiMo-V2-Flash)
    yarn: dict | None = None  # gpt-oss: YaRN's factor, beta_fast, beta_slow, original_max_position_embeddings, ...
    value_scale: float = 1.0  # MiMo-V2-Flash: values are multiplied by it before they are cached
    swiglu: tuple[float, float] | None = None  # gpt-oss: (alpha, limit) of its clamped SwiGLU experts
    plain_norm: bool = False  # RMSNorm as w * x / rms(x) rather than zero-centred (1 + w) (gpt-oss, MiMo)
    bailing: dict | None = None  # Bailing-hybrid (with ``kimi`` set): full-rank KDA gates, the decay's lower bound
    ring: dict | None = None  # Ring-linear: Lightning layers with RoPE inside (output norm ``groups``), fused q/k/v

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.mlp_only and (layer + 1) % self.sparse_step == 0

    def kv_heads_of(self, kind: str) -> int:
        """KV heads of an attention layer of ``kind`` (``full_attention`` or ``sliding_attention``)."""
        return self.sliding_kv_heads if kind == "sliding_attention" and self.sliding_kv_heads else self.kv_heads


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


def _bailing_config(raw: dict) -> RefConfig:
    """Bailing-hybrid as transformers saves it: Kimi-Linear's layout but for its gates, MLA with RoPE on the
    rope parts (its own theta), dense MLPs in the first layers; linear heads are the attention's."""
    kimi = _kimi_config({**raw, "linear_attn_config": {
        "num_heads": raw["num_attention_heads"], "head_dim": raw.get("linear_head_dim") or raw["head_dim"],
        "short_conv_kernel_size": raw["short_conv_kernel_size"]}})
    rope = raw.get("rope_parameters") or {}
    bound = raw["kda_lower_bound"] if raw.get("kda_safe_gate", True) else None
    return dataclasses.replace(kimi, model_type="bailing_hybrid", rope_theta=rope.get("rope_theta", raw.get("rope_theta")),
                               rotary_dim=raw["qk_rope_head_dim"], bailing={"lower_bound": bound})


def _ring_config(raw: dict) -> RefConfig:
    """Ring-linear (``bailing_moe_linear``), read as SGLang reads it: softmax attention at the last of every
    ``layer_group_size`` layers (and any left after the last whole group), Lightning layers elsewhere with one
    head_dim x head_dim state per query head; partial RoPE in both; dense MLPs before ``first_k_dense_replace``."""
    layers, group, heads = raw["num_hidden_layers"], raw.get("layer_group_size", 1), raw["num_attention_heads"]
    types = tuple("full_attention" if (i + 1) % group == 0 or i >= layers - layers % group else "linear_attention"
                  for i in range(layers))
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    rotary = int(head_dim * raw.get("partial_rotary_factor", 1.0))
    return RefConfig(
        model_type="bailing_moe_linear", layer_types=types, heads=heads, kv_heads=raw["num_key_value_heads"],
        head_dim=head_dim, key_heads=heads, value_heads=heads, key_dim=head_dim, value_dim=head_dim, conv_kernel=1,
        eps=raw["rms_norm_eps"], rope_theta=raw["rope_theta"], rotary_dim=rotary, rope_scale=1.0,
        experts=raw["num_experts"], top_k=raw["num_experts_per_tok"], norm_topk=raw["norm_topk_prob"], sparse_step=1,
        mlp_only=tuple(range(raw.get("first_k_dense_replace", 0))), linear_rotary_dim=rotary, plain_norm=True,
        routing={"groups": raw["n_group"], "top_groups": raw["topk_group"], "scaling": raw["routed_scaling_factor"]},
        ring={"groups": raw.get("group_norm_size", 1)},
    )


def _gpt_oss_config(raw: dict) -> RefConfig:
    """gpt-oss: attention in every layer (sliding at even layers by default), sinks, YaRN on the whole head,
    clamped SwiGLU experts in every layer. The hub's ``rope_scaling`` + ``rope_theta`` is the same dict."""
    layers, head_dim = raw["num_hidden_layers"], raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    hub_rope = {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 150000.0)}
    rope = raw.get("rope_parameters") or hub_rope
    assert rope.get("rope_type", rope.get("type")) == "yarn", rope
    return RefConfig(
        model_type="gpt_oss", layer_types=tuple(types), heads=raw["num_attention_heads"],
        kv_heads=raw["num_key_value_heads"], head_dim=head_dim, key_heads=0, value_heads=0, key_dim=0, value_dim=0,
        conv_kernel=1, eps=raw.get("rms_norm_eps", 1e-5), rope_theta=rope["rope_theta"], rotary_dim=head_dim,
        rope_scale=1.0,
        experts=raw.get("num_local_experts") or raw["num_experts"], top_k=raw["num_experts_per_tok"], norm_topk=True,
        sparse_step=1, mlp_only=(), window=raw["sliding_window"], yarn=rope,
        swiglu=(raw.get("swiglu_alpha", 1.702), raw.get("swiglu_limit", 7.0)), plain_norm=True,
    )


def _mimo_config(raw: dict) -> RefConfig:
    """MiMo-V2-Flash as transformers reads it: sliding layers with twice the KV heads (hard-coded: the hub's
    ``swa_num_key_value_heads`` is not read) and their own rope theta, a dense MLP in the "dense" layers. A
    ``sliding_window_size`` S means a window of S + 1 (the S previous tokens and the query itself)."""
    layers, kv_heads = raw["num_hidden_layers"], raw["num_key_value_heads"]
    types = raw.get("layer_types") or ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                       for i in range(layers)]
    mlp_types = raw.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    rope = raw.get("rope_parameters") or {"full_attention": {"rope_theta": 5e6, "partial_rotary_factor": 0.334},
                                          "sliding_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.334}}
    head_dim = raw["head_dim"]
    by_kind = {kind: (float(r["rope_theta"]), int(head_dim * r.get("partial_rotary_factor", 1.0)))
               for kind, r in rope.items()}
    window = raw["sliding_window_size"] + 1 if raw.get("sliding_window_size") is not None else raw["sliding_window"]
    scale = raw.get("attention_value_scale", 0.707)
    return RefConfig(
        model_type="mimo_v2_flash", layer_types=tuple(types), heads=raw["num_attention_heads"], kv_heads=kv_heads,
        head_dim=head_dim, key_heads=0, value_heads=0, key_dim=0, value_dim=0, conv_kernel=1,
        eps=raw.get("rms_norm_eps", 1e-5),  # the hub's "layernorm_epsilon" is not read by transformers
        rope_theta=by_kind["full_attention"][0], rotary_dim=by_kind["full_attention"][1], rope_scale=1.0,
        experts=raw.get("n_routed_experts") or raw.get("num_local_experts") or 0, top_k=raw["num_experts_per_tok"],
        norm_topk=raw.get("norm_topk_prob", True), sparse_step=1,
        mlp_only=tuple(i for i, kind in enumerate(mlp_types) if kind == "dense"), value_head_dim=raw["v_head_dim"],
        routing={"groups": raw.get("n_group", 1), "top_groups": raw.get("topk_group", 1),
                 "scaling": raw.get("routed_scaling_factor") or 1.0},
        window=window, sliding_kv_heads=2 * kv_heads, rope_by_kind=by_kind,
        value_scale=1.0 if scale is None else scale, plain_norm=True,
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
    if raw["model_type"] == "bailing_hybrid":
        return _bailing_config(raw)
    if raw["model_type"] == "nemotron_h":
        return _nemotron_config(raw)
    if raw["model_type"] == "bailing_moe_linear":
        return _ring_config(raw)
    if raw["model_type"] == "gpt_oss":
        return _gpt_oss_config(raw)
    if raw["model_type"] == "mimo_v2_flash":
        return _mimo_config(raw)
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


LING_NAMES = (("word_embeddings.", "embed_tokens."), (".attention.dense.", ".self_attn.o_proj."),
              (".attention.", ".self_attn."), (".gate.expert_bias", ".gate.e_score_correction_bias"))


RING_NAMES = (("word_embeddings.", "embed_tokens."), (".gate.expert_bias", ".gate.e_score_correction_bias"))
RENAMED = {"bailing_hybrid": LING_NAMES, "bailing_moe_linear": RING_NAMES}  # mixers keep Ring's names


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A Bailing (Ling, Ring) checkpoint's tensor under the names the reference reads."""
    for old, new in renames:
        name = name.replace(old, new)
    return name


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every text-model tensor in fp32, keyed like ``layers.0.linear_attn.A_log``."""
    tensors, renames = {}, RENAMED.get(json.loads((path / "config.json").read_text()).get("model_type"), ())
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                name = _short_name(key)
                if name is not None:
                    tensors[_renamed(name, renames)] = handle.get_tensor(key).float()
    if "lm_head.weight" not in tensors:  # tied embeddings
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    return tensors
