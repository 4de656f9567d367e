"""A quantized checkpoint read as the float checkpoint it stands for.

Each quantized tensor and its scales are one float tensor of the index, under the name and in the
layout the float checkpoint gives it (FP8 ``x.weight`` + ``x.weight_scale_inv``: ``x.weight``;
MXFP4 ``x_blocks`` + ``x_scales``: ``x``), dequantized in the compute dtype when read. So the
loader maps names and cuts tensor-parallel shares exactly as for a float checkpoint, and host
memory stays one tensor (plus a bounded float32 scratch) beyond the model.
"""
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError
from .quantization import Quantization, dequantize_fp8, dequantize_mxfp4, fp8_scale_grid
from .safetensors_reader import DTYPES, TensorInfo, TensorReader

log = logging.getLogger(__name__)
FP8_DTYPE = "F8_E4M3"
FP8_SCALE_DTYPES = {"F32", "BF16", "F16", "U8"}  # U8: e8m0 exponents
FP8_SCALE_SUFFIX = "_scale_inv"  # x.weight -> x.weight_scale_inv
MXFP4_BLOCKS, MXFP4_SCALES, MXFP4_BYTES = "_blocks", "_scales", 16  # 16 bytes: one group of 32 nibbles
ACTIVATION_SCALES = (".input_scale", ".activation_scale")  # static activation scales: no use to float weights
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Fp8Tensor:
    """A float8_e4m3fn tensor and its per-block scales (``block``: rows, columns; None: per matrix)."""

    weight: str
    scale: str
    block: tuple[int, int] | None

    def dequantize(self, reader: "DequantizingReader", dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(reader.read_stored(self.weight), reader.read_stored(self.scale), self.block, dtype)


@dataclass(frozen=True)
class Mxfp4Tensor:
    """Packed e2m1 blocks and their e8m0 scales. A stack of matrices ([E, out, in/32, 16]: gpt-oss's
    fused experts) is given in the float checkpoint's layout, [E, in, out] (a transposed view)."""

    blocks: str
    scales: str

    def dequantize(self, reader: "DequantizingReader", dtype: torch.dtype) -> torch.Tensor:
        tensor = dequantize_mxfp4(reader.read_stored(self.blocks), reader.read_stored(self.scales), dtype)
        return tensor.transpose(1, 2) if tensor.dim() == 3 else tensor


Packed = Fp8Tensor | Mxfp4Tensor


class DequantizingReader(TensorReader):
    """``index`` and ``read`` as a float checkpoint's: quantized tensors dequantized to ``dtype``.
    Raises ``CheckpointError`` naming a quantized tensor whose scales are missing or misshapen, a
    scale tensor with nothing to scale, or a module the config keeps float that is stored quantized."""

    def __init__(self, files: list[Path], quantization: Quantization, dtype: torch.dtype) -> None:
        super().__init__(files)
        self.stored, self.dtype = self.index, dtype
        self.packed = packed_tensors(self.stored, quantization)
        self.index = float_index(self.stored, self.packed, dtype)
        if not self.packed:
            log.warning("config.json declares %s quantization but no tensor is stored quantized", quantization.method)

    def read(self, name: str) -> torch.Tensor:
        packed = self.packed.get(name)
        return self.read_stored(name) if packed is None else packed.dequantize(self, self.dtype)

    def read_stored(self, name: str) -> torch.Tensor:
        """A tensor as the file holds it (quantized values, scales)."""
        return self._read_stored(name, self.stored[name])


def packed_tensors(stored: dict[str, TensorInfo], quantization: Quantization) -> dict[str, Packed]:
    """The quantized tensors of a checkpoint, by the float name each stands for, checked against
    their scales and the config's float modules."""
    found = _fp8_tensors(stored, quantization) if quantization.method == "fp8" else _mxfp4_tensors(stored)
    for name in found:
        module = name.removesuffix(".weight")
        if quantization.keeps_float(module):
            raise CheckpointError(f"{module} is listed in quantization_config.modules_to_not_convert but its "
                                  f"tensor {name} is stored quantized")
    _check_no_stray_scales(stored, found, quantization.method)
    return found


def _fp8_tensors(stored: dict[str, TensorInfo], quantization: Quantization) -> dict[str, Packed]:
    found: dict[str, Packed] = {}
    for name, info in stored.items():
        if info.dtype == FP8_DTYPE:
            scale = name + FP8_SCALE_SUFFIX
            _check_fp8_scale(name, info, scale, stored.get(scale), quantization.block_size)
            found[name] = Fp8Tensor(name, scale, quantization.block_size)
    return found


def _check_fp8_scale(name: str, info: TensorInfo, scale: str, scale_info: TensorInfo | None,
                     block: tuple[int, int] | None) -> None:
    if scale_info is None:
        raise CheckpointError(f"tensor {name} is float8_e4m3fn but its block scales {scale} are missing")
    if len(info.shape) < 2:
        raise CheckpointError(f"tensor {name} is float8_e4m3fn with shape {info.shape}: FP8 blocks need a matrix")
    expected = fp8_scale_grid(info.shape, block)
    per_matrix = block is None and math.prod(scale_info.shape) == math.prod(expected)  # a scalar scale per matrix
    if scale_info.shape != expected and not per_matrix:
        raise CheckpointError(f"scale tensor {scale} has shape {scale_info.shape}; {name} {info.shape} in blocks "
                              f"of {list(block) if block else 'one matrix'} needs {expected}")
    if scale_info.dtype not in FP8_SCALE_DTYPES:
        raise CheckpointError(f"scale tensor {scale} has dtype {scale_info.dtype}, not a float or e8m0 (U8) scale")


def _mxfp4_tensors(stored: dict[str, TensorInfo]) -> dict[str, Packed]:
    found: dict[str, Packed] = {}
    for name, info in stored.items():
        if name.endswith(MXFP4_BLOCKS) and info.dtype == "U8":
            base = name.removesuffix(MXFP4_BLOCKS)
            _check_mxfp4_scales(name, info, base + MXFP4_SCALES, stored.get(base + MXFP4_SCALES))
            found[base] = Mxfp4Tensor(name, base + MXFP4_SCALES)
    return found


def _check_mxfp4_scales(name: str, info: TensorInfo, scales: str, scales_info: TensorInfo | None) -> None:
    if scales_info is None:
        raise CheckpointError(f"tensor {name} holds MXFP4 blocks but its scales {scales} are missing")
    if len(info.shape) < 2 or info.shape[-1] != MXFP4_BYTES:
        raise CheckpointError(f"tensor {name} has shape {info.shape}: MXFP4 blocks end in groups of "
                              f"{MXFP4_BYTES} bytes (32 e2m1 values)")
    if scales_info.shape != info.shape[:-1] or scales_info.dtype != "U8":
        raise CheckpointError(f"scale tensor {scales} is {scales_info.dtype} {scales_info.shape}; the blocks "
                              f"{name} {info.shape} need U8 {info.shape[:-1]} (one e8m0 exponent per group)")


def _check_no_stray_scales(stored: dict[str, TensorInfo], found: dict[str, Packed], method: str) -> None:
    """A scale tensor that scales nothing means the checkpoint is not what its config says."""
    used = {_stored_keys(packed)[1] for packed in found.values()}
    suffix = FP8_SCALE_SUFFIX if method == "fp8" else MXFP4_SCALES
    stray = sorted(name for name in stored if name.endswith(suffix) and name not in used)
    if stray:
        raise CheckpointError(f"scale tensor {stray[0]} has no {method} tensor beside it to scale "
                              f"({len(stray)} such tensor(s))")


def float_index(stored: dict[str, TensorInfo], packed: dict[str, Packed], dtype: torch.dtype) -> dict[str, TensorInfo]:
    """The index a float checkpoint of these weights would have (scales and activation scales gone)."""
    consumed = {key for item in packed.values() for key in _stored_keys(item)}
    index = {name: info for name, info in stored.items()
             if name not in consumed and not name.endswith(ACTIVATION_SCALES)}
    for name, item in packed.items():
        info = stored[_stored_keys(item)[0]]
        index[name] = TensorInfo(info.file, DTYPE_NAMES[dtype], _float_shape(item, info.shape), info.begin, info.end)
    return index


def _stored_keys(item: Packed) -> tuple[str, str]:
    return (item.weight, item.scale) if isinstance(item, Fp8Tensor) else (item.blocks, item.scales)


def _float_shape(item: Packed, shape: tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(item, Fp8Tensor):
        return shape
    *leading, groups, width = shape
    float_shape = (*leading, groups * 2 * width)
    return (float_shape[0], float_shape[2], float_shape[1]) if len(float_shape) == 3 else float_shape
