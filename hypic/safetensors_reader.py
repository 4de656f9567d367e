"""Reads safetensors files one tensor at a time, straight from the file (no memory map).

A memory-mapped checkpoint keeps every page it touched resident until the map closes, so loading
through it costs the whole file in host memory on top of the model. Reading each tensor with
``readinto`` costs at most that one tensor (or nothing extra, when it lands in a buffer of its
own dtype).
"""
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .errors import CheckpointError, UnsupportedModel

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
FLOATS = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: its file, safetensors dtype, shape and byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(file: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file (the JSON header only)."""
    try:
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not a readable safetensors file: {err}") from None
    base = 8 + length
    return {name: TensorInfo(file, meta["dtype"], tuple(meta["shape"]), base + meta["data_offsets"][0],
                             base + meta["data_offsets"][1])
            for name, meta in header.items() if name != "__metadata__"}


class TensorReader:
    """Every tensor of a checkpoint directory's ``*.safetensors`` files, read on demand."""

    def __init__(self, files: list[Path]) -> None:
        self.index: dict[str, TensorInfo] = {}
        for file in files:
            self.index.update(read_header(file))
        self._handles: dict[Path, BinaryIO] = {}

    def check_dtypes(self) -> None:
        """Tensors the model is filled from must be float: refuse any other dtype by name (a quantized
        tensor not recognised as part of a format HYPIC dequantizes ends here)."""
        odd = sorted({info.dtype for info in self.index.values()} - FLOATS)
        if odd:
            example = next(name for name, info in self.index.items() if info.dtype in odd)
            raise UnsupportedModel(f"tensors of dtype {', '.join(odd)} (e.g. {example!r}) are not supported: HYPIC "
                                   "serves float checkpoints (float32, bfloat16, float16) and the fp8 and mxfp4 "
                                   "formats a quantization_config declares")

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in its stored dtype, on the CPU."""
        return self._read_stored(name, self.index[name])

    def _read_stored(self, name: str, info: TensorInfo) -> torch.Tensor:
        buffer = torch.empty(info.end - info.begin, dtype=torch.uint8)
        handle = self._handles.get(info.file)
        if handle is None:
            handle = self._handles[info.file] = info.file.open("rb")
        handle.seek(info.begin)
        if handle.readinto(memoryview(buffer.numpy())) != info.end - info.begin:
            raise CheckpointError(f"{info.file} ends inside tensor {name!r}")
        return buffer.view(DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
