"""Seeded random checkpoints of the supported architectures, written by ``transformers`` in HF format
from each architecture's tiny config (the placeholder model the CLI serves before a trained one is
given, ``hypic eval``'s study models, benchmarks and tests; nothing is downloaded). The tests' own
matrix of variants and their writers for architectures with no ``transformers`` class are theirs
(``hypic_testing.tiny_models``)."""
import sys
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ..models.arch import ARCHITECTURES, Architecture, architecture, qwen

END_OF_TEXT = "<|endoftext|>"
TINY_CONFIG: dict[str, Any] = qwen.TINY  # the Qwen3.5 text model's tiny config
FAMILY_CONFIGS: dict[str, dict[str, Any]] = {  # model type -> its architecture's tiny config (Qwen's: TINY_CONFIG)
    model_type: arch.tiny for arch in ARCHITECTURES if arch.tiny is not qwen.TINY for model_type in arch.model_types}


def byte_level_tokenizer() -> Tokenizer:
    """One token per byte (ids 0..255) plus ``<|endoftext|>`` (id 256): token counts are byte counts."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def reference_classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of ``transformers`` for a model type (a multimodal wrapper's:
    its conditional-generation class), on its PyTorch path."""
    if not torch.cuda.is_available():
        sys.modules.setdefault("fla", None)  # FLA's Triton kernels cannot run on CPU: force the fallback
    import importlib

    if model_type in WRAPPED_REFERENCES:
        names = WRAPPED_REFERENCES[model_type]
    else:
        arch = architecture(model_type)
        if arch.reference is None:
            raise ValueError(f"{model_type} has no transformers reference")
        names = arch.reference

    def load(name: str) -> type:
        module, _, attribute = f"transformers.{name}".rpartition(".")
        return getattr(importlib.import_module(module), attribute)
    return load(names[0]), load(names[1])


WRAPPED_REFERENCES = {"qwen3_5": ("models.qwen3_5.Qwen3_5Config", "models.qwen3_5.Qwen3_5ForConditionalGeneration")}


def _randomize(model: torch.nn.Module, generator: torch.Generator, arch: Architecture) -> None:
    """Zero-initialised norms would hide layout bugs, and the default decays (A up to 16) forget
    everything within a few tokens: give norms noise and the linear layers long memory (unless the
    architecture's own decays remember long, ``keeps_decay``; and, with ``noisy_biases``, attention
    sinks and biases noise too)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias", "conv1d.bias", "mamba.D", "mixer.D")):  # zero or one when initialised
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("A_log") and not arch.keeps_decay:
                param.copy_(torch.empty(param.shape).uniform_(1e-3, 3e-2, generator=generator).log())
            elif arch.noisy_biases and name.endswith(("sinks", "bias")):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # Kimi-Linear's router bias: zero would hide its use
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def write_random_checkpoint(path: str | Path, model_type: str = "qwen3_5_text", seed: int = 0,
                            **overrides: Any) -> Path:
    """Save a seeded random model (config.json, model.safetensors) and a byte-level tokenizer."""
    path = Path(path)
    config_class, model_class = reference_classes(model_type)
    fields = {**FAMILY_CONFIGS.get(model_type, TINY_CONFIG), **overrides}
    torch.manual_seed(seed)
    if model_type == "qwen3_5":
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=fields["hidden_size"])
        config = config_class(text_config=fields, vision_config=vision)
    else:
        config = config_class(**fields)
    config.eos_token_id = 256
    model = model_class(config).eval()
    _randomize(model, torch.Generator().manual_seed(seed), architecture(model_type))
    model.save_pretrained(path)
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    return path
