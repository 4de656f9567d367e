"""Typed model configuration parsed from an HF ``config.json`` (qwen3_next / qwen3_5 families)."""
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedModel

TEXT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "minimax", "granitemoehybrid", "kimi_linear",
                    "nemotron_h", "hypic_hybrid", "gpt_oss", "mimo_v2_flash")
LINEAR_FAMILIES = ("gated_delta", "lightning", "mamba2", "gla", "scalar_rope", "kda")
SCALAR_FAMILIES = ("lightning", "mamba2", "scalar_rope")  # T_C is one number per head
NATIVE_FAMILIES = ("gated_delta", "gla", "scalar_rope")  # what a hypic_hybrid config may name
WRAPPER_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")  # multimodal wrappers: text_config inside
ATTENTION_KINDS = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN's frequency blend (gpt-oss): frequencies below the ``beta_slow`` ramp end are divided by
    the rope factor, those above ``beta_fast`` kept; rotated channels are scaled by ``attention_factor``."""

    original_max_positions: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # round the ramp's ends to whole channels
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of the attention layers."""

    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rope_type: str = "default"
    factor: float = 1.0  # position scaling of rope_type "linear" (and YaRN's factor)
    yarn: YarnScaling | None = None


@dataclass(frozen=True)
class SlidingWindow:
    """Sliding-window attention layers (gpt-oss, MiMo-V2-Flash): a query at position i sees the keys at
    positions i - size < j <= i. Their rope and KV heads may differ from the full layers'."""

    size: int
    kv_heads: int | None = None  # None: as the full layers
    rope: RopeConfig | None = None  # None: as the full layers


@dataclass(frozen=True)
class ResidualScales:
    """Scaled residuals around post-norm sublayers (MiniMax): out = alpha * normed_input + beta *
    sublayer(normed_input), with (alpha, beta) per sublayer kind."""

    linear: tuple[float, float] = (1.0, 1.0)
    full: tuple[float, float] = (1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True)
class Mamba2Options:
    """What a Mamba2 layer needs beyond the shared linear-layer shapes (Granite-4.0-H)."""

    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))  # dt is clamped into it after softplus


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V3's layout; Kimi-Linear's full-attention layers): keys
    [k_nope (per head, from the kv latent) | k_rope (one part shared by the heads)], values from the
    same latent; cached as the latent itself (one head of kv_lora_rank + rope_dim key channels and
    kv_lora_rank value channels). Kimi-Linear applies no RoPE, so cached keys never need turning."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: a plain q_proj
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    value_dim: int  # v_head_dim


@dataclass(frozen=True)
class GroupedSigmoidRouting:
    """DeepSeek-V3's router (Kimi-Linear): sigmoid scores; the choice adds a per-expert bias and keeps
    only the ``top_groups`` best of ``groups`` expert groups; the chosen scores, renormalised when the
    config says so, are scaled by ``scaling``."""

    groups: int = 1
    top_groups: int = 1
    scaling: float = 1.0


@dataclass(frozen=True)
class BlockLayout:
    """Nemotron-H's checkpoint holds one sublayer per block (Mamba2, attention, MLP or MoE, each
    x + f(norm(x))); a token mixer and the feed-forward block after it are one layer of ours. Per
    layer: the mixer's block index, the feed-forward block's (None: a mixer-only layer) and its kind."""

    mixer_blocks: tuple[int, ...]
    ffn_blocks: tuple[int | None, ...]
    ffn_kinds: tuple[str | None, ...]  # "mlp" | "moe" | None


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runtime needs to know about a hybrid checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    linear_family: str = "gated_delta"  # the linear layers' token mixer: one of LINEAR_FAMILIES
    attention_output_gate: bool = True  # Qwen's sigmoid gate on the attention output (and q/k RMSNorm)
    rms_norm_unit_offset: bool = True  # Qwen's zero-centred norms (1 + w); False: plain w
    norm_weight_in_fp32: bool = False  # plain norms multiply w before casting back (Nemotron-H), not after
    residual_scales: ResidualScales | None = None  # None: pre-norm residuals x + f(norm(x))
    residual_multiplier: float = 1.0  # pre-norm residuals x + m f(norm(x)) (Granite)
    embedding_multiplier: float = 1.0  # embeddings scaled by it (Granite)
    logits_scaling: float = 1.0  # logits divided by it (Granite)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    shared_expert_gated: bool = True  # Qwen's sigmoid gate on the shared expert; Granite's is ungated
    mamba: Mamba2Options | None = None
    latent_attention: LatentAttention | None = None  # Kimi-Linear's MLA instead of q/k/v projections
    routing: GroupedSigmoidRouting | None = None  # None: softmax top-k
    blocks: BlockLayout | None = None  # Nemotron-H: single-sublayer blocks grouped into layers
    mlp_activation: str = "silu"  # "silu": SwiGLU (gate, up, down); "relu2": relu(up x)^2, then down (Nemotron-H)
    moe_latent_size: int | None = None  # Nemotron-H's latent MoE: experts work in a narrower space
    sliding_window: SlidingWindow | None = None  # the "sliding_attention" layers' window
    attention_sinks: tuple[str, ...] = ()  # layer kinds whose heads have a learned sink logit (gpt-oss)
    value_head_dim: int | None = None  # V narrower than K (MiMo-V2-Flash); None: head_dim
    value_scale: float = 1.0  # values are scaled by it before caching (MiMo-V2-Flash)
    output_bias: bool | None = None  # o_proj bias; None: as attention_bias
    swiglu_clamp: tuple[float, float] | None = None  # gpt-oss experts: (alpha, limit) of the clamped SwiGLU
    expert_bias: bool = False  # biases on the router and every expert projection (gpt-oss)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def attention_value_dim(self) -> int:
        """Width of a cached value head (keys: ``head_dim``); latent attention caches the latent as values."""
        if self.latent_attention is not None:
            return self.latent_attention.kv_lora_rank
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    def kv_heads(self, index: int) -> int:
        """KV heads of attention layer ``index`` (MiMo-V2-Flash's sliding layers have more)."""
        window = self.sliding_window
        if self.layer_types[index] == "sliding_attention" and window is not None and window.kv_heads is not None:
            return window.kv_heads
        return self.num_key_value_heads

    def kv_elements(self, index: int) -> int:
        """Elements of one token's key and value in attention layer ``index``."""
        return self.kv_heads(index) * (self.head_dim + self.attention_value_dim)

    def window(self, index: int) -> int | None:
        """Layer ``index``'s window (keys a query sees, itself included), None for full attention."""
        return self.sliding_window.size if self.layer_types[index] == "sliding_attention" and self.sliding_window else None

    def rope_of(self, kind: str) -> RopeConfig:
        """The rotary embedding of one attention layer kind."""
        if kind == "sliding_attention" and self.sliding_window is not None and self.sliding_window.rope is not None:
            return self.sliding_window.rope
        return self.rope

    @property
    def linear_conv_channels(self) -> int:
        """Channels of a Gated DeltaNet layer's short conv: [q | k | v]."""
        keys = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * keys + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_value_ratio(self) -> int:
        """Value heads per key head in the linear layers (GQA of Gated DeltaNet)."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def linear_transition_shape(self) -> tuple[int, ...]:
        """Shape of a cached T_C per linear layer: dense [Hv, K, K] (Gated DeltaNet), scalar [Hv] (Lightning)."""
        heads, dk = self.linear_num_value_heads, self.linear_key_head_dim
        if self.linear_family == "gla":
            return (heads, dk)
        return (heads,) if self.linear_family in SCALAR_FAMILIES else (heads, dk, dk)  # dense: GDN and KDA

    def is_moe_layer(self, index: int) -> bool:
        """Qwen3-Next's rule: MoE unless listed as MLP-only or off the sparse step (Nemotron-H: its block kind)."""
        if self.blocks is not None:
            return self.blocks.ffn_kinds[index] == "moe"
        if self.num_experts <= 0 or index in self.mlp_only_layers:
            return False
        return (index + 1) % self.decoder_sparse_step == 0

    def has_feed_forward(self, index: int) -> bool:
        """False for a Nemotron-H mixer block with no feed-forward block after it."""
        return self.blocks is None or self.blocks.ffn_kinds[index] is not None

    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def attention_layers(self) -> list[int]:
        """Layers that keep K/V: full and sliding-window attention."""
        return [i for i, t in enumerate(self.layer_types) if t in ATTENTION_KINDS]

    def window_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "sliding_attention"]


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Unwrap the multimodal Qwen3.5 wrapper to its language model's config."""
    model_type = raw.get("model_type")
    if model_type in WRAPPER_MODEL_TYPES:
        text = dict(raw.get("text_config") or {})
        text.setdefault("model_type", f"{model_type}_text")
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        text.setdefault("eos_token_id", raw.get("eos_token_id"))
        return text
    if model_type not in TEXT_MODEL_TYPES:
        known = ", ".join(TEXT_MODEL_TYPES + WRAPPER_MODEL_TYPES)
        raise UnsupportedModel(f"unknown model_type {model_type!r}: HYPIC runs {known}")
    return raw


def _rope_config(text: dict[str, Any]) -> RopeConfig:
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise UnsupportedModel(f"rope_type {rope_type!r} is not supported (default, linear)")
    return RopeConfig(
        theta=float(params.get("rope_theta", text.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
    )


def _layer_types(text: dict[str, Any], kinds: tuple[str, ...] = ("linear_attention", "full_attention")) -> tuple[str, ...]:
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - set(kinds):
        raise UnsupportedModel(f"layer_types {types!r} do not describe {layers} layers of kinds {', '.join(kinds)}")
    return tuple(types)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def _minimax_layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, or the original checkpoints' ``attn_type_list`` (0: lightning, 1: softmax)."""
    if text.get("layer_types") is None and text.get("attn_type_list") is not None:
        kinds = {0: "linear_attention", 1: "full_attention"}
        return _layer_types({**text, "layer_types": [kinds.get(int(t), str(t)) for t in text["attn_type_list"]]})
    if text.get("layer_types") is None:  # transformers' default: full attention first, then alternating
        types = ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(int(text["num_hidden_layers"]))]
        return _layer_types({**text, "layer_types": types})
    return _layer_types(text)


def minimax_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """MiniMax-Text-01 (``minimax``): Lightning attention layers (one state of head_dim x head_dim
    per attention head, no conv), plain softmax attention with full rotary, a routed MoE in every
    layer, post-norm residuals scaled by the config's alpha / beta factors."""
    if text.get("sliding_window") is not None:
        raise UnsupportedModel("minimax with sliding_window is not supported (sliding-window hybrids are not served yet)")
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"minimax with hidden_act {text['hidden_act']!r} is not supported (silu)")
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
        eos_token_ids=_eos_ids(text.get("eos_token_id")), linear_family="lightning", attention_output_gate=False,
        rms_norm_unit_offset=False,
        residual_scales=ResidualScales((factor("linear_attn_alpha_factor"), factor("linear_attn_beta_factor")),
                                       (factor("full_attn_alpha_factor"), factor("full_attn_beta_factor")),
                                       (factor("mlp_alpha_factor"), factor("mlp_beta_factor"))),
        raw=raw,
    )


def _json_float(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


GRANITE_LAYER_KINDS = {"mamba": "linear_attention", "attention": "full_attention",
                       "linear_attention": "linear_attention", "full_attention": "full_attention"}


def granite_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """Granite-4.0-H (``granitemoehybrid``): Mamba2 layers (a state of d_state x head_dim per head, scalar
    decay exp(dt A), B and C shared by head groups, conv with bias, D skip, grouped gated norm),
    plain attention with RoPE or none, routed experts plus an ungated shared MLP (or the shared MLP
    alone), Granite's embedding, residual, attention and logits multipliers."""
    kinds = text.get("layer_types") or text.get("layers_block_type")
    if kinds is None or any(kind not in GRANITE_LAYER_KINDS for kind in kinds):
        raise UnsupportedModel(f"granitemoehybrid layer types {kinds!r}: expected mamba / attention per layer")
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"granitemoehybrid with hidden_act {text['hidden_act']!r} is not supported (silu)")
    hidden, heads, groups = int(text["hidden_size"]), int(text["mamba_n_heads"]), int(text["mamba_n_groups"])
    head_dim, experts = int(text["mamba_d_head"]), int(text.get("num_local_experts") or 0)
    if int(text.get("mamba_expand", 2) * hidden) != heads * head_dim or heads % groups:
        raise UnsupportedModel("granitemoehybrid: mamba_expand x hidden_size must equal mamba_n_heads x mamba_d_head, "
                               "and the heads must split evenly into mamba_n_groups")
    rope = dict(text.get("rope_parameters") or {})
    attention_heads = int(text["num_attention_heads"])
    limit = tuple(_json_float(v) for v in (text.get("time_step_limit") or (0.0, float("inf"))))
    return ModelConfig(
        model_type="granitemoehybrid", vocab_size=int(text["vocab_size"]), hidden_size=hidden,
        num_hidden_layers=int(text["num_hidden_layers"]),
        layer_types=_layer_types({**text, "layer_types": [GRANITE_LAYER_KINDS[k] for k in kinds]}),
        num_attention_heads=attention_heads, num_key_value_heads=int(text.get("num_key_value_heads") or attention_heads),
        head_dim=int(text.get("head_dim") or hidden // attention_heads), linear_num_key_heads=groups,
        linear_num_value_heads=heads, linear_key_head_dim=int(text["mamba_d_state"]), linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=int(text.get("mamba_d_conv", 4)),
        intermediate_size=int(text["shared_intermediate_size"] if not experts else text["intermediate_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig(theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                        partial_rotary_factor=1.0 if text.get("position_embedding_type") == "rope" else 0.0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)), num_experts=experts,
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0), moe_intermediate_size=int(text["intermediate_size"]),
        shared_expert_intermediate_size=int(text["shared_intermediate_size"]), norm_topk_prob=True,
        attention_bias=bool(text.get("attention_bias", False)), eos_token_ids=_eos_ids(text.get("eos_token_id")),
        linear_family="mamba2", attention_output_gate=False, rms_norm_unit_offset=False,
        residual_multiplier=float(text.get("residual_multiplier", 1.0)),
        embedding_multiplier=float(text.get("embedding_multiplier", 1.0)),
        logits_scaling=float(text.get("logits_scaling", 1.0)), attention_scale=float(text.get("attention_multiplier", 1.0)),
        shared_expert_gated=False,
        mamba=Mamba2Options(bool(text.get("mamba_conv_bias", True)), bool(text.get("mamba_proj_bias", False)),
                            (limit[0], limit[1])),
        raw=raw,
    )


def _first(text: dict[str, Any], names: tuple[str, ...], default: Any = None) -> Any:
    """The first of ``names`` set in ``text``: transformers saves some Kimi-Linear fields under their
    attribute-map names (``num_experts`` for ``num_local_experts``), original checkpoints the others."""
    return next((text[name] for name in names if text.get(name) is not None), default)


def _kimi_layer_types(text: dict[str, Any], layers: int, linear: dict[str, Any]) -> tuple[str, ...]:
    """``layer_types``, or the original ``linear_attn_config`` lists (1-indexed), or transformers' default."""
    if text.get("layer_types") is None and "full_attn_layers" in linear:
        full = {int(i) - 1 for i in linear["full_attn_layers"]}
        types = ["full_attention" if i in full else "linear_attention" for i in range(layers)]
        return _layer_types({**text, "layer_types": types})
    if text.get("layer_types") is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
        return _layer_types({**text, "layer_types": types})
    return _layer_types(text)


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
        raise UnsupportedModel(f"kimi_linear with hidden_act {text['hidden_act']!r} is not supported (silu)")
    heads, layers = int(text["num_attention_heads"]), int(text["num_hidden_layers"])
    if int(text.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedModel("kimi_linear: latent attention gives every head its own keys (num_key_value_heads "
                               "must equal num_attention_heads)")
    linear = dict(text.get("linear_attn_config") or {})
    linear_heads = int(linear.get("num_heads", text.get("linear_num_heads", 32)))
    linear_dim = int(linear.get("head_dim", text.get("linear_head_dim", 128)))
    latent = LatentAttention(int(text["kv_lora_rank"]), text.get("q_lora_rank"), int(text["qk_nope_head_dim"]),
                             int(text["qk_rope_head_dim"]), int(text.get("v_head_dim") or text["qk_nope_head_dim"]))
    experts = int(_first(text, ("num_experts", "num_local_experts"), 0))
    expert_size = int(text["moe_intermediate_size"])
    return ModelConfig(  # the attention fields describe the cache: one latent head of kv_lora_rank + rope keys
        model_type="kimi_linear", vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
        num_hidden_layers=layers, layer_types=_kimi_layer_types(text, layers, linear), num_attention_heads=heads,
        num_key_value_heads=1, head_dim=latent.kv_lora_rank + latent.rope_dim, linear_num_key_heads=linear_heads,
        linear_num_value_heads=linear_heads, linear_key_head_dim=linear_dim, linear_value_head_dim=linear_dim,
        linear_conv_kernel_dim=int(linear.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4))),
        intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(_first(text, ("model_max_length", "max_position_embeddings"), 1 << 20)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope=RopeConfig(partial_rotary_factor=0.0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)), num_experts=experts,
        num_experts_per_tok=int(_first(text, ("num_experts_per_token", "num_experts_per_tok"), 0)),
        moe_intermediate_size=expert_size,
        shared_expert_intermediate_size=expert_size * int(_first(text, ("num_shared_experts", "n_shared_experts"), 0)),
        norm_topk_prob=bool(_first(text, ("moe_renormalize", "norm_topk_prob"), True)),
        mlp_only_layers=_kimi_dense_layers(text, layers), attention_bias=bool(text.get("attention_bias", False)),
        eos_token_ids=_eos_ids(text.get("eos_token_id")), linear_family="kda", attention_output_gate=False,
        rms_norm_unit_offset=False, shared_expert_gated=False, latent_attention=latent,
        routing=GroupedSigmoidRouting(int(_first(text, ("num_expert_group", "n_group"), 1)),
                                      int(text.get("topk_group") or 1), float(text.get("routed_scaling_factor", 1.0))),
        raw=raw,
    )


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
            raise UnsupportedModel(f"nemotron_h block {index} ({kind!r}) does not follow a Mamba2 or attention block: "
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
            raise UnsupportedModel(f"nemotron_h with {name} {text[name]!r} is not supported ({expected})")
    if text.get("mlp_bias"):
        raise UnsupportedModel("nemotron_h with mlp_bias is not supported")
    if text.get("sliding_window") is not None:
        raise UnsupportedModel("nemotron_h with sliding_window is not supported (sliding-window hybrids are not served yet)")
    layout = nemotron_layout(list(kinds))
    hidden, heads, groups = int(text["hidden_size"]), int(text["mamba_num_heads"]), int(text.get("n_groups", 8))
    if heads % groups:
        raise UnsupportedModel("nemotron_h: mamba_num_heads must split evenly into n_groups")
    attention_heads = int(text["num_attention_heads"])
    limit = tuple(_json_float(v) for v in (text.get("time_step_limit") or (0.0, float("inf"))))
    experts = int(_first(text, ("n_routed_experts", "num_local_experts"), 0))
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
        norm_topk_prob=bool(text.get("norm_topk_prob", True)), eos_token_ids=_eos_ids(text.get("eos_token_id")),
        linear_family="mamba2", attention_output_gate=False, rms_norm_unit_offset=False, norm_weight_in_fp32=True,
        shared_expert_gated=False, mamba=Mamba2Options(bool(text.get("use_conv_bias", True)), bool(text.get("use_bias", False)), (limit[0], limit[1])),
        routing=GroupedSigmoidRouting(int(text.get("n_group", 1)), int(text.get("topk_group", 1)),
                                      float(text.get("routed_scaling_factor", 1.0))),
        blocks=layout, mlp_activation="relu2", moe_latent_size=text.get("moe_latent_size"), raw=raw,
    )


def _rope_of(params: dict[str, Any], theta: float, partial: float = 1.0) -> RopeConfig:
    """A rope config from HF ``rope_parameters`` (default, linear or YaRN)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "yarn"):
        raise UnsupportedModel(f"rope_type {rope_type!r} is not supported (default, linear, yarn)")
    yarn = None
    if rope_type == "yarn":
        yarn = YarnScaling(int(params["original_max_position_embeddings"]), float(params.get("beta_fast", 32.0)),
                           float(params.get("beta_slow", 1.0)), bool(params.get("truncate", True)),
                           params.get("attention_factor"))
    return RopeConfig(theta=float(params.get("rope_theta", theta)),
                      partial_rotary_factor=float(params.get("partial_rotary_factor", partial)), rope_type=rope_type,
                      factor=float(params.get("factor", 1.0)), yarn=yarn)


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
        layer_types=_layer_types({**text, "layer_types": types}, ATTENTION_KINDS), num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads") or heads), head_dim=int(text.get("head_dim") or hidden // heads),
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=1, intermediate_size=size,
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope=_rope_of(params, float(text.get("rope_theta", 150000.0))),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        num_experts=int(_first(text, ("num_local_experts", "num_experts"), 0)),
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0), moe_intermediate_size=size, norm_topk_prob=True,
        attention_bias=bool(text.get("attention_bias", True)), eos_token_ids=_eos_ids(text.get("eos_token_id")),
        attention_output_gate=False, rms_norm_unit_offset=False, norm_weight_in_fp32=True,
        sliding_window=SlidingWindow(int(text["sliding_window"])), attention_sinks=ATTENTION_KINDS,
        swiglu_clamp=(float(text.get("swiglu_alpha", 1.702)), float(text.get("swiglu_limit", 7.0))), expert_bias=True,
        raw=raw,
    )


def _mimo_rope(text: dict[str, Any], kind: str) -> RopeConfig:
    defaults = {"full_attention": 5e6, "sliding_attention": 1e4}
    params = dict((text.get("rope_parameters") or {}).get(kind) or {})
    return _rope_of(params, defaults[kind], 0.334)


def mimo_config(text: dict[str, Any], raw: dict[str, Any]) -> ModelConfig:
    """MiMo-V2-Flash (``mimo_v2_flash``): sliding-window attention (twice the KV heads, sink logits,
    its own rope theta) with a full-attention layer first and every sixth; keys 192 wide (64 rotated),
    values 128 wide and scaled by 0.707; DeepSeek-V3 sigmoid routing without shared experts, dense
    MLP in the first layer."""
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"mimo_v2_flash with hidden_act {text['hidden_act']!r} is not supported (silu)")
    heads, hidden, layers = int(text["num_attention_heads"]), int(text["hidden_size"]), int(text["num_hidden_layers"])
    types = text.get("layer_types") or ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention"
                                        for i in range(layers)]
    window = int(text["sliding_window_size"]) + 1 if text.get("sliding_window_size") is not None else int(text["sliding_window"])
    kv_heads = int(text["num_key_value_heads"])
    dense = text.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    scale = text.get("attention_value_scale", 0.707)
    return ModelConfig(
        model_type="mimo_v2_flash", vocab_size=int(text["vocab_size"]), hidden_size=hidden, num_hidden_layers=layers,
        layer_types=_layer_types({**text, "layer_types": types}, ATTENTION_KINDS), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=int(text.get("head_dim") or hidden // heads),
        linear_num_key_heads=0, linear_num_value_heads=0, linear_key_head_dim=0, linear_value_head_dim=0,
        linear_conv_kernel_dim=1, intermediate_size=int(text["intermediate_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope=_mimo_rope(text, "full_attention"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        num_experts=int(_first(text, ("n_routed_experts", "num_local_experts"), 0)),
        num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        mlp_only_layers=tuple(i for i, kind in enumerate(dense) if kind == "dense"),
        attention_bias=bool(text.get("attention_bias", False)), eos_token_ids=_eos_ids(text.get("eos_token_id")),
        attention_output_gate=False, rms_norm_unit_offset=False, shared_expert_gated=False,
        routing=GroupedSigmoidRouting(int(text.get("n_group") or 1), int(text.get("topk_group") or 1),
                                      float(text.get("routed_scaling_factor") or 1.0)),
        sliding_window=SlidingWindow(window, 2 * kv_heads, _mimo_rope(text, "sliding_attention")),
        attention_sinks=("sliding_attention",), value_head_dim=int(text.get("v_head_dim") or text.get("head_dim")),
        value_scale=1.0 if scale is None else float(scale), output_bias=False, raw=raw,
    )


FAMILY_CONFIGS = {"gpt_oss": gpt_oss_config, "mimo_v2_flash": mimo_config, "minimax": minimax_config, "granitemoehybrid": granite_config, "kimi_linear": kimi_config,
                  "nemotron_h": nemotron_config}


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Build a ``ModelConfig`` from a loaded ``config.json``; raises ``UnsupportedModel``."""
    text = _text_config(raw)
    if text["model_type"] in FAMILY_CONFIGS:
        try:
            return FAMILY_CONFIGS[text["model_type"]](text, raw)
        except KeyError as missing:
            raise UnsupportedModel(f"config.json lacks the field {missing.args[0]!r}") from None
    try:
        heads = int(text["num_attention_heads"])
        return ModelConfig(
            model_type=text["model_type"], vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]), layer_types=_layer_types(text),
            num_attention_heads=heads, num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // heads),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]), linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(text.get("intermediate_size") or 0),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope=_rope_config(text),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            num_experts=int(text.get("num_experts") or 0), num_experts_per_tok=int(text.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(text.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            decoder_sparse_step=int(text.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
            attention_bias=bool(text.get("attention_bias", False)), eos_token_ids=_eos_ids(text.get("eos_token_id")),
            linear_family=_native_family(text), raw=raw,
        )
    except KeyError as missing:
        raise UnsupportedModel(f"config.json lacks the field {missing.args[0]!r}") from None


def _native_family(text: dict[str, Any]) -> str:
    """The linear family of a ``hypic_hybrid`` config (Qwen3.5's fields plus ``linear_family``): gla
    wants a key head per value head; scalar_rope also equal key and value widths and no conv
    (``linear_conv_kernel_dim`` 1). Other model types are Gated DeltaNet."""
    if text["model_type"] != "hypic_hybrid":
        return "gated_delta"
    family = text.get("linear_family", "gated_delta")
    if family not in NATIVE_FAMILIES:
        raise UnsupportedModel(f"hypic_hybrid linear_family {family!r}: one of {', '.join(NATIVE_FAMILIES)}")
    same_heads = text["linear_num_key_heads"] == text["linear_num_value_heads"]
    if family == "gla" and not same_heads:
        raise UnsupportedModel("hypic_hybrid with gla needs linear_num_key_heads == linear_num_value_heads")
    if family == "scalar_rope" and not (same_heads and text["linear_key_head_dim"] == text["linear_value_head_dim"]
                                        and text.get("linear_conv_kernel_dim") == 1):
        raise UnsupportedModel("hypic_hybrid with scalar_rope needs equal key and value heads and widths and "
                               "linear_conv_kernel_dim 1")
    return family
