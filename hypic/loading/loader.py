"""Load a local HF-format hybrid checkpoint (config.json + *.safetensors) into ``HybridModel``.

The model is built without memory, allocated once on the target device in the target dtype, and
each parameter is filled from the checkpoint tensors it comes from, read one at a time: host
memory beyond the model itself stays about one tensor. FP8 and MXFP4 checkpoints are dequantized
tensor by tensor as they are read (``hypic.loading.dequantizing_reader``); other quantized ones are refused
by method.
"""
import contextlib
import functools
import hashlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..config import ModelConfig
from ..errors import CheckpointError
from ..models import HybridModel
from ..models.arch import architecture, parse_config
from ..models.families import FAMILIES, family_of
from ..parallel import TensorParallel
from ..parallel.sharding import rank_config, sharding_rules, take
from .dequantizing_reader import DequantizingReader
from .quantization import Quantization, quantization_of
from .safetensors_reader import DTYPES, TensorReader
from .tensor_sources import Deinterleaved, Direct, ExpertStack, RowHalf, Source

log = logging.getLogger(__name__)
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "backbone.")  # backbone: Nemotron-H
IGNORED = re.compile(r"^(model\.visual\.|visual\.|mtp\.|model\.mtp\.)"
                     r"|\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$")  # MiniMax's derived buffers
FINGERPRINT_SAMPLE = 1 << 20  # bytes read at each end of a weight file
LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
GROUPS = ("self_attn", "mlp", "shared_mlp")  # a layer's tensor groups besides the linear families' own


def _raw_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{config_file} is not valid JSON: {err}") from None


def read_config(path: Path) -> ModelConfig:
    """Parse ``config.json`` of a checkpoint directory; a quantization other than fp8 or mxfp4 is
    refused by method."""
    raw = _raw_config(path)
    quantization_of(raw)
    return parse_config(raw)


def read_quantization(path: str | Path) -> Quantization | None:
    """The quantization a checkpoint declares in ``config.json`` (None: a float checkpoint)."""
    return quantization_of(_raw_config(Path(path)))


def open_checkpoint(path: Path, dtype: torch.dtype) -> TensorReader:
    """The checkpoint's tensors as float tensors: a quantized one's dequantized to ``dtype`` when read."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weight files")
    quantization = read_quantization(path)
    reader = TensorReader(files) if quantization is None else DequantizingReader(files, quantization, dtype)
    reader.check_dtypes()
    return reader


def checkpoint_dtype(path: Path) -> torch.dtype:
    """The dtype a checkpoint was saved in: config's ``dtype`` / ``torch_dtype``, else its weights'."""
    raw = json.loads((path / "config.json").read_text())
    named = raw.get("dtype") or raw.get("torch_dtype") or (raw.get("text_config") or {}).get("dtype")
    if isinstance(named, str) and isinstance(getattr(torch, named, None), torch.dtype):
        return getattr(torch, named)
    reader = TensorReader(sorted(path.glob("*.safetensors")))
    stored = [DTYPES.get(info.dtype) for info in reader.index.values()]
    floats = [dtype for dtype in stored if dtype is not None and dtype.is_floating_point and dtype.itemsize > 1]
    return max(set(floats), key=floats.count) if floats else torch.float32


DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices natively (else they run emulated, ~7x slower)."""
    if dtype is torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype is torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def resolve_dtype(name: str, path: Path, device: str) -> torch.dtype:
    """``auto``: the checkpoint's dtype, except half precision on a CPU without native support for it
    (float32 there: the same answers, several times faster). Other names are taken as given."""
    if name != "auto":
        return DTYPE_NAMES[name]
    read_config(path)  # a missing or bad config is said as such, before anything reads it
    stored = checkpoint_dtype(path)
    stored = stored if stored in DTYPE_NAMES.values() else torch.float32
    if torch.device(device).type == "cpu" and not _native(stored):
        log.info("dtype auto: the checkpoint is %s, which this CPU does not multiply natively: using float32", stored)
        return torch.float32
    return stored


def _strip_prefix(key: str) -> str:
    for prefix in TEXT_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))  # Qwen's; Mixtral's and MiniMax's
RENAMED_MLP = {"gate.weight": "router.weight", "router.layer.weight": "router.weight",  # Granite: fused experts
               "input_linear.weight": "gate_up_proj", "output_linear.weight": "down_proj",
               "gate.e_score_correction_bias": "router_bias"}  # Kimi-Linear (DeepSeek-V3's router)


def _mlp_name(name: str) -> str:
    """Our name of an MLP block's tensor (Kimi-Linear's ``shared_experts.`` is our ``shared_expert.``)."""
    if name.startswith("shared_experts."):
        return "shared_expert." + name.removeprefix("shared_experts.")
    return RENAMED_MLP.get(name, name)


GPT_OSS_EXPERTS = {"experts.gate_up_proj": ("gate_up_proj", True), "experts.gate_up_proj_bias": ("gate_up_bias", False)}


def _gpt_oss_experts(keys: dict[str, str]) -> dict[str, Source]:
    """gpt-oss's fused experts: [E, H, 2I] interleaved gate / up, [E, I, H] down, and their biases."""
    out: dict[str, Source] = {ours: Deinterleaved(keys[name], transposed)
                              for name, (ours, transposed) in GPT_OSS_EXPERTS.items() if name in keys}
    if "experts.down_proj" in keys:
        out["down_proj"] = Direct(keys["experts.down_proj"], transposed=True)
    if "experts.down_proj_bias" in keys:
        out["down_bias"] = Direct(keys["experts.down_proj_bias"])
    return out


def _mlp_sources(prefix: str, keys: dict[str, str], interleaved: bool = False) -> dict[str, Source]:
    """Sources of one MLP / MoE block: fused ``experts.gate_up_proj`` or per-expert tensors stacked
    (``interleaved``: gpt-oss's fused experts, gate and up interleaved)."""
    out: dict[str, Source] = {_mlp_name(name): Direct(key) for name, key in keys.items() if not name.startswith("experts.")}
    if interleaved:
        return {f"{prefix}mlp.{name}": source for name, source in {**out, **_gpt_oss_experts(keys)}.items()}
    for up in ("gate_up_proj", "up_proj"):  # fused [gate | up] (SwiGLU) or up alone (Nemotron-H's squared ReLU)
        if f"experts.{up}" in keys:
            out[up], out["down_proj"] = Direct(keys[f"experts.{up}"]), Direct(keys["experts.down_proj"])
    ids = sorted({int(n.split(".")[1]) for n in keys if n.startswith("experts.") and n.split(".")[1].isdigit()})
    if ids:
        pick = lambda e, proj: keys.get(f"experts.{e}.{proj}.weight", f"<experts.{e}.{proj}.weight>")  # noqa: E731
        names = next((n for n in EXPERT_NAMES if f"experts.{ids[0]}.{n[0]}.weight" in keys), None)
        if names is None:  # ungated experts, up and down only (Nemotron-H's squared ReLU)
            out["up_proj"] = ExpertStack(tuple((pick(e, "up_proj"),) for e in ids))
        else:
            out["gate_up_proj"] = ExpertStack(tuple((pick(e, names[0]), pick(e, names[1])) for e in ids))
        down = "down_proj" if names is None else names[2]
        out["down_proj"] = ExpertStack(tuple((pick(e, down),) for e in ids))
    return {f"{prefix}mlp.{name}": source for name, source in out.items()}


def _shared_mlp_sources(config: ModelConfig, prefix: str, keys: dict[str, str]) -> dict[str, Source]:
    """Granite's shared MLP ([gate | up] packed in ``input_linear``): the MoE's ungated shared expert,
    or the whole feed-forward of a dense model."""
    if not keys:
        return {}
    target = f"{prefix}mlp.shared_expert." if config.num_experts > 0 else f"{prefix}mlp."
    return {target + "gate_proj.weight": RowHalf(keys["input_linear.weight"], True),
            target + "up_proj.weight": RowHalf(keys["input_linear.weight"], False),
            target + "down_proj.weight": Direct(keys["output_linear.weight"])}


def _mixer_sources(config: ModelConfig, index: int, prefix: str, groups: dict[str, dict[str, str]]) -> dict[str, Source]:
    """The token mixer's parameters: by the layer's kind and the model's linear family."""
    if config.layer_types[index] != "linear_attention":  # MiMo-V2-Flash's original name of the sinks
        return {f"{prefix}mixer.{'sinks' if n == 'attention_sink_bias' else n}": Direct(k)
                for n, k in groups.get("self_attn", {}).items()}
    family = family_of(config)
    return family.checkpoint(config, prefix, groups.get(family.checkpoint_group, {}))


def parameter_sources(config: ModelConfig, checkpoint_keys: list[str]) -> tuple[dict[str, Source], list[str]]:
    """Where each ``HybridModel`` parameter comes from in the checkpoint, and the keys nothing uses."""
    per_layer: dict[int, dict[str, dict[str, str]]] = {}
    sources: dict[str, Source] = {}
    arch = architecture(config.model_type)
    checkpoint_groups = {family.checkpoint_group for family in FAMILIES.values()}
    for key in checkpoint_keys:
        if IGNORED.match(key):
            continue
        short = _strip_prefix(key) if arch.rename is None else arch.rename(config, _strip_prefix(key))
        match = LAYER_KEY.match(short)
        if not match:
            sources[short] = Direct(key)
            continue
        head, _, rest = match.group(2).partition(".")
        head = "mlp" if head == "block_sparse_moe" else head  # Mixtral-style MoE names (MiniMax)
        group = head if head in GROUPS or head in checkpoint_groups else ""
        per_layer.setdefault(int(match.group(1)), {}).setdefault(group, {})[rest if group else match.group(2)] = key
    for index, groups in per_layer.items():
        prefix = f"layers.{index}."
        sources.update({prefix + name: Direct(key) for name, key in groups.get("", {}).items()})
        sources.update(_mixer_sources(config, index, prefix, groups))
        sources.update(_mlp_sources(prefix, groups.get("mlp", {}), arch.fused_experts))
        sources.update(_shared_mlp_sources(config, prefix, groups.get("shared_mlp", {})))
    if config.tie_word_embeddings and "embed_tokens.weight" in sources:
        sources.setdefault("lm_head.weight", sources["embed_tokens.weight"])
    if arch.sources is not None:
        sources = arch.sources(config, sources)
    used = {k for source in sources.values() for k in source.keys}
    return sources, sorted(k for k in checkpoint_keys if k not in used and not IGNORED.match(k))


def _plan(model: HybridModel, sources: dict[str, Source], reader: TensorReader) -> None:
    """Every parameter has a source whose tensors exist; said before any memory is allocated."""
    names = [name for name, _ in model.named_parameters()]
    missing = [n for n in names if n not in sources or any(k not in reader.index for k in sources[n].keys)]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")


INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                  "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """``torch.nn.init``'s functions made no-ops while modules are built on the meta device: every
    parameter is filled from the checkpoint next, and initialising a meta tensor imports torch's
    compiler, over a second of every serving process's start. Module-wide: a module another thread
    builds meanwhile is left uninitialised too."""
    saved = {name: getattr(nn.init, name) for name in INIT_FUNCTIONS}
    for name in saved:
        setattr(nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def _unchanged(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
               tp: TensorParallel = TensorParallel()) -> HybridModel:
    """Build the model of a checkpoint directory on ``device`` in ``dtype``, filling each parameter
    from its checkpoint tensors one at a time; raises ``CheckpointError`` naming any bad tensor.
    ``tp``: only this rank's share of each tensor is kept (a model whose heads do not divide the
    ranks is refused, naming the count, before anything is read)."""
    path = Path(path)
    config = read_config(path)
    rank = rank_config(config, tp)
    reader = open_checkpoint(path, dtype)
    sources, unused = parameter_sources(config, list(reader.index))
    with torch.device("meta"), initialisation_skipped():
        model = HybridModel(rank)
    _plan(model, sources, reader)
    rules = sharding_rules(model)
    if unused:
        log.warning("ignoring %d unexpected tensor(s), e.g. %s", len(unused), unused[:5])
    model = model.to(dtype=dtype).to_empty(device=device)
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():
                sources[name].fill(name, param, reader, functools.partial(take, rule=rules.get(name), tp=tp))
    finally:
        reader.close()
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
