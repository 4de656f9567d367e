"""Typed model configuration: what the runtime needs to know about a hybrid checkpoint, and the
helpers the architectures' parsers share (``hypic.models.arch`` reads each ``config.json``)."""
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedModel, as_written
from .parallel.group import TensorParallel

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
    rotary_dim: int | None = None  # rotated channels of a head; None: head_dim x partial_rotary_factor
    rotated_last: bool = False  # the rotated channels end the head (latent attention's [latent | rope key])


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
    kv_lora_rank value channels). Kimi-Linear applies no RoPE, so its cached keys never need turning;
    Bailing-hybrid rotates the rope parts (``rotary``), with DeepSeek's interleaved channel pairs
    (``interleaved``), and gates each head's output by a sigmoid (``output_gate``)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: a plain q_proj
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    value_dim: int  # v_head_dim
    rotary: bool = False
    interleaved: bool = False  # rotated pairs are channels (2i, 2i + 1), not (i, i + rope_dim / 2)
    output_gate: bool = False  # out_h *= sigmoid(g_proj(x))_h before o_proj


@dataclass(frozen=True)
class KDAGates:
    """How a Kimi Delta Attention layer computes its forget and output gates. Kimi-Linear: low-rank
    projections (f_a, f_b; g_a, g_b) and g = -exp(A_log) softplus(f + dt_bias). Bailing-hybrid:
    full-rank f_proj and g_proj, and with a ``lower_bound`` the bounded g = lower_bound x
    sigmoid(exp(A_log) (f + dt_bias))."""

    full_rank: bool = False
    lower_bound: float | None = None  # None: the softplus form


@dataclass(frozen=True)
class RingLinear:
    """Ring-linear's Lightning layers (``bailing_moe_linear``) where they differ from our own
    scalar_rope form: q, k and v projected as [Q | K | V] blocks without an activation, each head's q
    and k RMS-normed (plain weights) before RoPE, the output RMS-normed over ``norm_groups`` equal
    groups of heads (plain weights, the config's eps), and the slopes of SGLang's Bailing backend."""

    norm_groups: int = 1


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
    linear_family: str = "gated_delta"  # the linear layers' family: a name in hypic.models.families
    attention_output_gate: bool = True  # Qwen's sigmoid gate on the attention output (and q/k RMSNorm)
    attention_qk_norm: bool | None = None  # q/k RMSNorm per head; None: with the output gate (Ring-linear: without)
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
    kda_gates: KDAGates = KDAGates()  # the KDA layers' gate projections (linear_family "kda")
    ring_linear: RingLinear | None = None  # scalar_rope layers in Ring-linear's form (bailing_moe_linear)
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
    tensor_parallel: TensorParallel = TensorParallel()  # this rank's place; its head counts above are its share
    unsharded: "ModelConfig | None" = field(default=None, compare=False, repr=False)  # the whole model's, on a rank
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def whole(self) -> "ModelConfig":
        """The config of the whole model (this one, without tensor parallelism)."""
        return self.unsharded or self

    @property
    def rotary_dim(self) -> int:
        if self.rope.rotary_dim is not None:
            return self.rope.rotary_dim
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
        """Channels of a linear layer's short conv inputs: [q | k | v] (Gated DeltaNet's widths, which
        every family's share)."""
        keys = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * keys + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_value_ratio(self) -> int:
        """Value heads per key head in the linear layers (GQA of Gated DeltaNet)."""
        return self.linear_num_value_heads // self.linear_num_key_heads

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


# ----- helpers of the architectures' parsers ----------------------------------------------------
def parse_layer_types(text: dict[str, Any], kinds: tuple[str, ...] = ("linear_attention", "full_attention")) -> tuple[str, ...]:
    layers = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if types is None:
        interval = int(text.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - set(kinds):
        raise UnsupportedModel(f"layer_types {as_written(types)} do not describe {layers} layers of kinds {', '.join(kinds)}")
    return tuple(types)


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def json_float(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def first_set(text: dict[str, Any], names: tuple[str, ...], default: Any = None) -> Any:
    """The first of ``names`` set in ``text``: transformers saves some fields under their attribute-map
    names (Kimi-Linear's ``num_experts`` for ``num_local_experts``), original checkpoints the others."""
    return next((text[name] for name in names if text.get(name) is not None), default)


def rope_from_params(params: dict[str, Any], theta: float, partial: float = 1.0) -> RopeConfig:
    """A rope config from HF ``rope_parameters`` (default, linear or YaRN)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear", "yarn"):
        raise UnsupportedModel(f"rope_type {as_written(rope_type)} is not supported (default, linear, yarn)")
    yarn = None
    if rope_type == "yarn":
        yarn = YarnScaling(int(params["original_max_position_embeddings"]), float(params.get("beta_fast", 32.0)),
                           float(params.get("beta_slow", 1.0)), bool(params.get("truncate", True)),
                           params.get("attention_factor"))
    return RopeConfig(theta=float(params.get("rope_theta", theta)),
                      partial_rotary_factor=float(params.get("partial_rotary_factor", partial)), rope_type=rope_type,
                      factor=float(params.get("factor", 1.0)), yarn=yarn)
