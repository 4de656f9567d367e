"""Load a local HF-format hybrid checkpoint (config.json + *.safetensors) into ``HybridModel``."""
import hashlib
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig, parse_config
from .errors import CheckpointError
from .models import HybridModel

log = logging.getLogger(__name__)
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
IGNORED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)")
FINGERPRINT_SAMPLE = 1 << 20  # bytes read at each end of a weight file
LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def read_config(path: Path) -> ModelConfig:
    """Parse ``config.json`` of a checkpoint directory."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        return parse_config(json.loads(config_file.read_text()))
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file} is not valid JSON: {err}") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All text-model tensors, keyed without the text-model prefix (``lm_head.weight`` kept)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if not IGNORED.match(key):
                    tensors[_strip_prefix(key)] = handle.get_tensor(key)
    return tensors


def _strip_prefix(key: str) -> str:
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def _split_qkvz(config: ModelConfig, qkvz: torch.Tensor, ba: torch.Tensor) -> dict[str, torch.Tensor]:
    """Qwen3-Next packs q, k, v, z (and b, a) per key-head group; unpack to the conv's channel order."""
    groups, ratio, hidden = config.linear_num_key_heads, config.linear_value_ratio, qkvz.shape[-1]
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    try:
        q, k, v, z = qkvz.view(groups, -1, hidden).split([dk, dk, ratio * dv, ratio * dv], dim=1)
        b, a = ba.view(groups, -1, hidden).split([ratio, ratio], dim=1)
    except RuntimeError:
        raise CheckpointError(f"in_proj_qkvz {tuple(qkvz.shape)} / in_proj_ba {tuple(ba.shape)} do not match the config") from None
    flat = lambda x: x.reshape(-1, hidden)  # noqa: E731 - [groups, n, H] -> [groups * n, H]
    return {"in_proj_qkv.weight": torch.cat([flat(q), flat(k), flat(v)]), "in_proj_z.weight": flat(z),
            "in_proj_b.weight": flat(b), "in_proj_a.weight": flat(a)}


def _linear_mixer(config: ModelConfig, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v for k, v in src.items() if not k.startswith(("in_proj_qkvz", "in_proj_ba", "conv1d"))}
    if "in_proj_qkvz.weight" in src and "in_proj_ba.weight" in src:
        out.update(_split_qkvz(config, src["in_proj_qkvz.weight"], src["in_proj_ba.weight"]))
    if "conv1d.weight" in src:
        out["conv_weight"] = src["conv1d.weight"].flatten(1) if src["conv1d.weight"].dim() == 3 else src["conv1d.weight"]
    return out


def _experts(src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused ``experts.gate_up_proj`` as is, or per-expert ``experts.{e}.*_proj`` stacked."""
    out = {k: v for k, v in src.items() if not k.startswith("experts.")}
    if "gate.weight" in out:
        out["router.weight"] = out.pop("gate.weight")
    if "experts.gate_up_proj" in src:
        out["gate_up_proj"], out["down_proj"] = src["experts.gate_up_proj"], src["experts.down_proj"]
        return out
    ids = sorted({int(k.split(".")[1]) for k in src if k.startswith("experts.") and k.split(".")[1].isdigit()})
    if ids:
        pick = lambda e, name: src.get(f"experts.{e}.{name}.weight")  # noqa: E731
        if any(pick(e, n) is None for e in ids for n in ("gate_proj", "up_proj", "down_proj")):
            raise CheckpointError("an expert lacks one of gate_proj / up_proj / down_proj")
        out["gate_up_proj"] = torch.stack([torch.cat([pick(e, "gate_proj"), pick(e, "up_proj")]) for e in ids])
        out["down_proj"] = torch.stack([pick(e, "down_proj") for e in ids])
    return out


def _layer_tensors(config: ModelConfig, index: int, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename one decoder layer's checkpoint tensors to ``HybridModel`` parameter names."""
    groups: dict[str, dict[str, torch.Tensor]] = {"linear_attn": {}, "self_attn": {}, "mlp": {}, "": {}}
    for key, value in src.items():
        head, _, rest = key.partition(".")
        groups[head if head in groups else ""][rest if head in groups else key] = value
    out = {f"layers.{index}.{k}": v for k, v in groups[""].items()}
    mixer = _linear_mixer(config, groups["linear_attn"]) if config.layer_types[index] == "linear_attention" else groups["self_attn"]
    out.update({f"layers.{index}.mixer.{k}": v for k, v in mixer.items()})
    out.update({f"layers.{index}.mlp.{k}": v for k, v in _experts(groups["mlp"]).items()})
    return out


def canonical_state_dict(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors renamed and re-packed to our parameter names."""
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        match = LAYER_KEY.match(key)
        if match:
            per_layer.setdefault(int(match.group(1)), {})[match.group(2)] = value
        else:
            out[key] = value
    for index, src in per_layer.items():
        out.update(_layer_tensors(config, index, src))
    if config.tie_word_embeddings and "embed_tokens.weight" in out:
        out.setdefault("lm_head.weight", out["embed_tokens.weight"])
    return out


def _check_tensors(model: HybridModel, state: dict[str, torch.Tensor]) -> None:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(state[name].shape)}, the config expects {shape}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        log.warning("ignoring %d unexpected tensor(s), e.g. %s", len(unexpected), unexpected[:5])


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> HybridModel:
    """Build the model of a checkpoint directory; raises ``CheckpointError`` naming any bad tensor."""
    path = Path(path)
    config = read_config(path)
    state = canonical_state_dict(config, _read_tensors(path))
    with torch.device("meta"):
        model = HybridModel(config)
    _check_tensors(model, state)
    model.load_state_dict({k: state[k] for k in model.state_dict()}, assign=True, strict=True)
    return model.to_device(device, dtype).eval().requires_grad_(False)


def model_fingerprint(path: str | Path) -> str:
    """Identity of a checkpoint for cache keys: config bytes, weight sizes and sampled weight bytes."""
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        with file.open("rb") as handle:
            head = handle.read(FINGERPRINT_SAMPLE)
            handle.seek(max(0, size - FINGERPRINT_SAMPLE))
            digest.update(f"{file.name}:{size}".encode() + head + handle.read())
    return digest.hexdigest()[:16]
