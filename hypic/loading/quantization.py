"""Quantized checkpoints HYPIC loads, and their dequantization to float weights.

Two formats are read: block-scaled FP8 (``quant_method: fp8``: float8_e4m3fn weights, each
``weight_block_size`` block of a matrix multiplied by one ``*_scale_inv`` value) and MXFP4
(``quant_method: mxfp4``: e2m1 values packed two per byte in ``*_blocks``, each run of 32 along
the input features multiplied by 2^(e - 127) from the uint8 ``*_scales``). Both are turned back
into float weights while loading; every other method is refused by name.
"""
import functools
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedModel, as_written

LOADED_METHODS = ("fp8", "mxfp4")
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by nibble
CHUNK_ELEMENTS = 1 << 24  # elements dequantized per step: scratch of 64 MiB (FP8) to ~256 MiB (MXFP4)


@dataclass(frozen=True)
class Quantization:
    """What ``quantization_config`` says: the method, FP8's block (rows, columns; None: one scale per
    matrix), the modules kept in float (``modules_to_not_convert`` / ``ignored_layers``, ``*`` any
    name part) and how activations were to be scaled (irrelevant to dequantized weights)."""

    method: str
    block_size: tuple[int, int] | None
    not_converted: tuple[str, ...]
    activation_scheme: str | None

    def keeps_float(self, module: str) -> bool:
        """Whether the checkpoint says ``module`` (a dotted module name) was left unquantized."""
        return bool(self.not_converted) and self._not_converted_pattern.search(module) is not None

    @functools.cached_property
    def _not_converted_pattern(self) -> re.Pattern[str]:
        """An entry matches a module whose dotted name contains it on name boundaries."""
        bodies = (r"[^.]*".join(re.escape(part) for part in entry.split("*")) for entry in self.not_converted)
        return re.compile(rf"(^|\.)(?:{'|'.join(bodies)})(\.|$)")

    def describe(self) -> dict[str, Any]:
        """What ``/get_model_info`` reports: the checkpoint's format and how its weights are held."""
        return {"method": self.method, "weight_block_size": list(self.block_size) if self.block_size else None,
                "activation_scheme": self.activation_scheme, "modules_to_not_convert": list(self.not_converted),
                "weights_held": "dequantized"}


def quantization_of(raw: dict[str, Any]) -> Quantization | None:
    """The quantization a raw ``config.json`` declares (its own or its ``text_config``'s), None for a
    float checkpoint; a method other than fp8 or mxfp4 is refused by name."""
    declared = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if not declared:
        return None
    if not isinstance(declared, dict):
        raise UnsupportedModel(f"the checkpoint is quantized ({as_written(declared)} in quantization_config): HYPIC loads "
                               f"{' and '.join(LOADED_METHODS)} checkpoints and float ones")
    method = str(declared.get("quant_method", "unknown")).lower()
    if method not in LOADED_METHODS:
        raise UnsupportedModel(f"the checkpoint is quantized ({as_written(method)} in quantization_config): HYPIC loads "
                               f"{' and '.join(LOADED_METHODS)} checkpoints (dequantized at load) and float ones")
    return Quantization(method, _block_size(declared) if method == "fp8" else None, _not_converted(declared),
                        declared.get("activation_scheme"))


def _block_size(declared: dict[str, Any]) -> tuple[int, int] | None:
    block = declared.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"quantization_config.weight_block_size must be two positive integers, got {as_written(block)}")
    return (block[0], block[1])


def _not_converted(declared: dict[str, Any]) -> tuple[str, ...]:
    entries = declared.get("modules_to_not_convert") or declared.get("ignored_layers") or []
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise CheckpointError(f"quantization_config.modules_to_not_convert must be a list of names, got {as_written(entries)}")
    return tuple(entries)


# ----- FP8 -------------------------------------------------------------------------------------

def fp8_scale_grid(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape of the scales of an FP8 tensor: one per block of its last two axes (the edge blocks
    may be partial); ``block`` None: one per matrix."""
    *leading, rows, cols = shape
    if block is None:
        return (*leading, 1, 1)
    return (*leading, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (float8_e4m3fn, [..., R, C]) times its block's ``scale_inv`` (float, or e8m0 bytes),
    computed in float32 and rounded once to ``dtype``; float32 scratch stays one chunk of rows."""
    rows, cols = weight.shape[-2:]
    block_rows, block_cols = block or (rows, cols)
    grids = _scale_values(scale_inv).reshape(-1, math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    out = torch.empty(weight.shape, dtype=dtype)
    step = block_rows * max(1, CHUNK_ELEMENTS // (block_rows * cols))  # whole block rows at a time
    for matrix, grid, target in zip(weight.reshape(-1, rows, cols), grids, out.view(-1, rows, cols)):
        for top in range(0, rows, step):
            scales = grid[top // block_rows : (top + step) // block_rows]
            target[top : top + step] = _fp8_rows(matrix[top : top + step], scales, block_rows, block_cols)
    return out


def _fp8_rows(rows: torch.Tensor, grid: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """Rows of one matrix (starting on a block boundary) times their blocks' scales, in float32; the
    scales broadcast over each block's columns (a partial last block column on its own)."""
    count, cols = rows.shape
    values, scales = rows.float(), grid.repeat_interleave(block_rows, 0)[:count]  # scales: [count, block columns]
    whole = cols // block_cols
    values[:, : whole * block_cols].unflatten(1, (whole, block_cols)).mul_(scales[:, :whole, None])
    values[:, whole * block_cols :].mul_(scales[:, whole:])  # the partial block column, if any
    return values


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: e8m0 bytes (uint8, ``scale_fmt: ue8m0``) are powers of two 2^(b - 127)."""
    if scale.dtype == torch.uint8:
        return torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32) - E8M0_BIAS)
    return scale.float()


# ----- MXFP4 -----------------------------------------------------------------------------------

def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` [..., G, 16] (two e2m1 nibbles a byte, the low one first) and ``scales`` [..., G]
    (e8m0) -> [..., 32 G] in ``dtype``; exact in any float dtype (an e2m1 value is at most 2 bits of
    mantissa, the scale a power of two)."""
    *leading, groups, width = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    flat_blocks, flat_scales = blocks.reshape(-1, width), scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    out = torch.empty(flat_blocks.shape[0], 2 * width, dtype=dtype)
    step = max(1, CHUNK_ELEMENTS // (2 * width))
    for top in range(0, flat_blocks.shape[0], step):
        packed = flat_blocks[top : top + step].to(torch.int64)
        values = torch.stack([table[packed & 0xF], table[packed >> 4]], dim=-1).flatten(1)
        out[top : top + step] = torch.ldexp(values, flat_scales[top : top + step])
    return out.reshape(*leading, groups * 2 * width)
