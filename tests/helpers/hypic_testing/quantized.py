"""Quantized copies of float checkpoints, written the way the formats define them (for the loader's
tests and benchmark): block-scaled FP8 as Qwen's FP8 releases ship it, MXFP4 experts as gpt-oss
ships them. Written from the formats' definitions, not from the loader's code."""
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2^2: the e2m1 exponent an MX block's scale leaves to its largest element
QWEN_FLOAT_MODULES = ("lm_head", "embed_tokens", "in_proj_a", "in_proj_b", "in_proj_ba", "mlp.gate",
                      "shared_expert_gate", "router")  # kept in float by Qwen's FP8 releases (and gpt-oss's router)
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
GPT_OSS_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int],
                        power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (float8_e4m3fn [R, C], float32 scale_inv [ceil(R/br), ceil(C/bc)]): each block's
    largest magnitude maps to 448 (``power_of_two``: scale_inv rounded up to a power of two, as e8m0
    scales are); edge blocks are partial (zero padding never moves the maximum)."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv))) if power_of_two else scale_inv
    scaled = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).view_as(padded)[:rows, :cols].contiguous(), scale_inv


def _quantized_fp8(name: str, tensor: torch.Tensor, float_modules: tuple[str, ...]) -> bool:
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and tensor.dim() == 2 and not any(
        module.endswith(entry) or f"{entry}." in module for entry in float_modules)


def write_fp8_checkpoint(source: Path, target: Path, block: tuple[int, int] | None = (128, 128),
                         scale_dtype: torch.dtype = torch.float32,
                         float_modules: tuple[str, ...] = QWEN_FLOAT_MODULES) -> Path:
    """A copy of ``source`` with every 2-D linear weight outside ``float_modules`` in block-scaled FP8
    (``block`` None: one scale per matrix; ``scale_dtype`` uint8: e8m0 scales, ``scale_fmt: ue8m0``),
    the config's ``quantization_config`` as Qwen's releases write it (``modules_to_not_convert``: each
    float linear module by name)."""
    target = Path(shutil.copytree(source, target))
    tensors, out, kept = load_file(str(source / "model.safetensors")), {}, []
    e8m0 = scale_dtype == torch.uint8
    for name, tensor in tensors.items():
        if _quantized_fp8(name, tensor, float_modules):
            out[name], scale = quantize_fp8_blocks(tensor, block or tuple(tensor.shape), e8m0)
            out[name + "_scale_inv"] = (torch.log2(scale) + 127).to(torch.uint8) if e8m0 else scale.to(scale_dtype)
        else:
            out[name] = tensor
            kept += [name.removesuffix(".weight")] if name.endswith(".weight") and tensor.dim() == 2 else []
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    _declare(target, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": list(block) if block else None, "modules_to_not_convert": kept,
                      **({"scale_fmt": "ue8m0"} if e8m0 else {})})
    return target


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N] (N a multiple of 32) -> (uint8 blocks [..., N/32, 16], uint8 e8m0 scales [..., N/32]).
    Each group of 32 shares the exponent floor(log2(max |x|)) - 2 (the OCP MX rule for e2m1); each
    element is rounded to the nearest e2m1 value, saturating at 6; nibble 2k is byte k's low one."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_MAX_EXPONENT, torch.full_like(amax, -127))
    exponent = exponent.clamp(-127, 127)
    codes = _nearest_e2m1(groups / torch.exp2(exponent))
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def e2m1_value(code: torch.Tensor) -> torch.Tensor:
    """The value of a 4-bit e2m1 code: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent
    0 is subnormal (0 or 0.5)."""
    sign = torch.where(code >> 3 == 1, -1.0, 1.0)
    exponent, mantissa = ((code >> 1) & 3).float(), (code & 1).float()
    normal = torch.exp2(exponent - 1) * (1 + mantissa / 2)
    return sign * torch.where(exponent == 0, mantissa / 2, normal)


def _nearest_e2m1(values: torch.Tensor) -> torch.Tensor:
    codes = torch.arange(16)
    grid = e2m1_value(codes)
    return codes[(values.clamp(-6, 6)[..., None] - grid).abs().argmin(dim=-1)]


def write_mxfp4_checkpoint(source: Path, target: Path) -> Path:
    """A copy of a gpt-oss checkpoint whose experts are MXFP4 as gpt-oss ships them: ``*_blocks``
    [E, out, in/32, 16] and ``*_scales`` [E, out, in/32] (groups along the input features), biases,
    attention, router and embeddings float, and the published ``quantization_config``."""
    target = Path(shutil.copytree(source, target))
    out = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.endswith(GPT_OSS_EXPERTS):  # float [E, in, out] (x @ W)
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2))
        else:
            out[name] = tensor
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    _declare(target, {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED})
    return target


def _declare(target: Path, quantization: dict) -> None:
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization
    (target / "config.json").write_text(json.dumps(config, indent=2))
