"""The tests' tiny random checkpoints: the matrix of variants the model tests run on
(``TINY_VARIANTS``: model type and config overrides; ``REFERENCE_MODEL_TYPES``: those a reference
implementation checks), and writers of the architectures ``transformers`` has no class of: our own
``hypic_hybrid`` families (``write_native_checkpoint``) and Ring-linear in its published names
(``write_published_checkpoint``)."""
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from hypic.loading.checkpoints import TINY_CONFIG, WRAPPED_REFERENCES, byte_level_tokenizer
from hypic.models import HybridModel
from hypic.models.arch import ARCHITECTURES, architecture, parse_config

MOE_CONFIG: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=32)

NATIVE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # our own model types (hypic_hybrid): name -> (family, overrides)
    "hypic_gla": ("gla", dict(linear_num_key_heads=4)),
    "hypic_scalar_rope": ("scalar_rope", dict(linear_num_key_heads=4, linear_conv_kernel_dim=1, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}


def _init_native(model: torch.nn.Module, generator: torch.Generator) -> None:
    """transformers' initialisation in spirit: weights N(0, 0.02), conv taps U(-0.5, 0.5), norms
    near their neutral value (0 for zero-centred ones, 1 for the gated output norm) with 0.1 noise."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_((param if name.endswith("mixer.norm.weight") else torch.zeros_like(param)) + 0.1 * noise)
            elif name.endswith("conv_weight"):
                param.copy_(torch.rand(param.shape, generator=generator) - 0.5)
            else:
                param.copy_(0.02 * noise)


def write_native_checkpoint(path: str | Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a seeded random ``hypic_hybrid`` model whose linear layers are ``family`` (gla, scalar_rope:
    model types of ours, with no ``transformers`` class), in our own parameter names, with a
    byte-level tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fields = {**TINY_CONFIG, "model_type": "hypic_hybrid", "linear_family": family, "eos_token_id": 256, "rms_norm_eps": 1e-6,
              "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"], **overrides}
    model = HybridModel(parse_config(fields))
    _init_native(model, torch.Generator().manual_seed(seed))
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return path


def _ring_linear_tensors(fields: dict[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Ring-linear's tensors as its checkpoints name them (SGLang's and vLLM's loaders read these):
    every layer's mixer under ``attention`` (a Lightning layer's fused [Q | K | V] of all heads, its
    g_proj gate and g_norm; a softmax layer's fused [Q | K | V] of the GQA heads), dense MLPs in the
    first ``first_k_dense_replace`` layers, then routed experts with ``gate.expert_bias`` and shared experts."""
    hidden, heads, kv_heads, layers = (fields[k] for k in ("hidden_size", "num_attention_heads",
                                                           "num_key_value_heads", "num_hidden_layers"))
    dim, group = fields.get("head_dim") or hidden // heads, fields["layer_group_size"]
    weight = lambda *shape, std=0.02: std * torch.randn(shape, generator=generator)  # noqa: E731
    norm = lambda width: 1 + 0.1 * torch.randn(width, generator=generator)  # noqa: E731
    out = {"model.word_embeddings.weight": weight(fields["vocab_size"], hidden), "model.norm.weight": norm(hidden),
           "lm_head.weight": weight(fields["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        softmax = (i + 1) % group == 0 or i >= layers // group * group
        out.update({p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
                    p + "attention.query_key_value.weight": weight((heads + 2 * (kv_heads if softmax else heads)) * dim, hidden),
                    p + "attention.query_layernorm.weight": norm(dim), p + "attention.key_layernorm.weight": norm(dim),
                    p + "attention.dense.weight": weight(hidden, heads * dim)})
        if not softmax:
            out.update({p + "attention.g_proj.weight": weight(heads * dim, hidden),
                        p + "attention.g_norm.weight": norm(heads * dim)})
        out.update(_ring_feed_forward(fields, p + "mlp.", i, weight))
    return out


def _ring_feed_forward(fields: dict[str, Any], p: str, index: int, weight: Any) -> dict[str, torch.Tensor]:
    """A dense SwiGLU MLP, or the MoE: router, its bias, experts and the shared experts' MLP."""
    hidden = fields["hidden_size"]

    def swiglu(prefix: str, inner: int) -> dict[str, torch.Tensor]:
        return {prefix + "gate_proj.weight": weight(inner, hidden), prefix + "up_proj.weight": weight(inner, hidden),
                prefix + "down_proj.weight": weight(hidden, inner)}

    if index < fields["first_k_dense_replace"]:
        return swiglu(p, fields["intermediate_size"])
    experts = fields["num_experts"]
    out = {p + "gate.weight": weight(experts, hidden), p + "gate.expert_bias": weight(experts, std=0.1)}  # zero would hide its use
    for e in range(experts):
        out.update(swiglu(f"{p}experts.{e}.", fields["moe_intermediate_size"]))
    return {**out, **swiglu(p + "shared_experts.", fields["moe_shared_expert_intermediate_size"] * fields["num_shared_experts"])}


PUBLISHED_TENSORS = {"bailing_moe_linear": _ring_linear_tensors}  # model types with no transformers class
PUBLISHED_ARCHITECTURES = {"bailing_moe_linear": "BailingMoeLinearV2ForCausalLM"}


def write_published_checkpoint(path: str | Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a seeded random model of an architecture ``transformers`` has no class of (Ring-linear's
    ``bailing_moe_linear``): config.json with its published keys (its architecture's tiny config),
    model.safetensors with its published tensor names, and a byte-level tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fields = {**architecture(model_type).tiny, **overrides, "model_type": model_type,
              "architectures": [PUBLISHED_ARCHITECTURES[model_type]]}
    tensors = PUBLISHED_TENSORS[model_type](fields, torch.Generator().manual_seed(seed))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return path


PUBLISHED_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (model_type, overrides), no transformers class
    "bailing_moe_linear": ("bailing_moe_linear", {}),
}

TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (model_type, overrides): the test matrix
    "qwen3_5_text-ratio2": ("qwen3_5_text", {}),
    "qwen3_5_text-ratio1": ("qwen3_5_text", dict(linear_num_value_heads=2)),
    "qwen3_5_text-ratio3": ("qwen3_5_text", dict(linear_num_value_heads=6)),
    "qwen3_5_text-long-context": ("qwen3_5_text", dict(max_position_embeddings=16384)),
    "qwen3_5_text-kv-heavy": ("qwen3_5_text", dict(  # KV dwarfs the linear states: memory tests of the private pool
        head_dim=256, max_position_embeddings=8192,
        layer_types=["linear_attention", "full_attention", "full_attention", "full_attention"])),
    "qwen3_5_text-full-rotary": ("qwen3_5_text", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 1.0})),
    "qwen3_next-moe": ("qwen3_next", dict(MOE_CONFIG)),
    "qwen3_next-dense": ("qwen3_next", dict(num_experts=0)),
    "qwen3_next-ratio3": ("qwen3_next", dict(num_experts=0, linear_num_value_heads=6)),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(MOE_CONFIG)),
    "qwen3_5-wrapper": ("qwen3_5", {}),
    "minimax": ("minimax", {}),
    "minimax-residual-scales": ("minimax", dict(linear_attn_alpha_factor=0.7, linear_attn_beta_factor=1.3,
                                                full_attn_alpha_factor=1.1, full_attn_beta_factor=0.9,
                                                mlp_alpha_factor=0.8, mlp_beta_factor=1.2)),
    "granitemoehybrid": ("granitemoehybrid", {}),
    "granitemoehybrid-dense-nope": ("granitemoehybrid", dict(num_local_experts=0, position_embedding_type="nope",
                                                             embedding_multiplier=3.0, residual_multiplier=0.5,
                                                             attention_multiplier=0.1, logits_scaling=2.0)),
    "granitemoehybrid-tp2": ("granitemoehybrid", dict(mamba_n_groups=1)),  # one group (Granite-4.0-H): 2 ranks share it
    "kimi_linear": ("kimi_linear", {}),
    "kimi_linear-dense-q-lora": ("kimi_linear", dict(first_k_dense_replace=4, q_lora_rank=24)),
    "nemotron_h": ("nemotron_h", {}),
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss-clamped": ("gpt_oss", dict(swiglu_limit=0.05)),  # the clamps bite on most expert activations
    "gpt_oss-kv1": ("gpt_oss", dict(num_key_value_heads=1)),  # one KV head: replicated under tensor parallelism
    "mimo_v2_flash": ("mimo_v2_flash", {}),
    "nemotron_h-latent-moe": ("nemotron_h", dict(moe_latent_size=24)),
    "nemotron_h-dense": ("nemotron_h", dict(layers_block_type=["linear_attention", "mlp", "linear_attention",
                                                               "full_attention", "mlp", "linear_attention", "mlp"],
                                            n_routed_experts=0)),
    "nemotron_h-dense-tp2": ("nemotron_h", dict(layers_block_type=["linear_attention", "mlp", "linear_attention",
                                                                   "full_attention", "mlp", "linear_attention", "mlp"],
                                                n_routed_experts=0, n_groups=1)),  # one group over two ranks
    "bailing_hybrid": ("bailing_hybrid", {}),
    "bailing_hybrid-dense-softplus": ("bailing_hybrid", dict(  # no q latent, the unbounded decay, dense MLPs only
        q_lora_rank=None, kda_safe_gate=False, first_k_dense_replace=4)),
}
FAMILY_CHECKPOINTS = ("qwen3_5_text-ratio2", "minimax", "granitemoehybrid", "hypic_gla",
                      "hypic_scalar_rope", "kimi_linear", "nemotron_h")  # one tiny model per linear family
REFERENCE_MODEL_TYPES = (*(t for arch in ARCHITECTURES if arch.reference for t in arch.model_types),
                         *WRAPPED_REFERENCES)  # hypic_reference runs these
