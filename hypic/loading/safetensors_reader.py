"""Reads safetensors files one tensor at a time, each through a memory map of its own bytes.

A tensor is handed out as a view of a private map of its byte range, so only the pages its reader
copies out are read from the file: a tensor-parallel rank that keeps a quarter of a matrix's rows
reads a quarter of it. The map closes with the last view of it, once the loader has copied what
it keeps, so a load never holds more of the file than the one tensor it is on (one map for the
whole checkpoint would keep every page it touched resident until the end).
"""
import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError, UnsupportedModel, as_written

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

    def check_dtypes(self) -> None:
        """Tensors the model is filled from must be float: refuse any other dtype by name (a quantized
        tensor not recognised as part of a format HYPIC dequantizes ends here)."""
        odd = sorted({info.dtype for info in self.index.values()} - FLOATS)
        if odd:
            example = next(name for name, info in self.index.items() if info.dtype in odd)
            raise UnsupportedModel(f"tensors of dtype {', '.join(odd)} (e.g. {as_written(example)}) are not supported: HYPIC "
                                   "serves float checkpoints (float32, bfloat16, float16) and the fp8 and mxfp4 "
                                   "formats a quantization_config declares")

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` in its stored dtype, on the CPU: a copy-on-write view of the file (the
        pages its reader touches are read; writing to it changes only this process's copy)."""
        return self._read_stored(name, self.index[name])

    def _read_stored(self, name: str, info: TensorInfo) -> torch.Tensor:
        dtype, size = DTYPES[info.dtype], info.end - info.begin
        if size == 0:
            return torch.empty(info.shape, dtype=dtype)
        start = info.begin - info.begin % mmap.ALLOCATIONGRANULARITY
        try:
            with info.file.open("rb") as handle:
                mapped = mmap.mmap(handle.fileno(), info.end - start, access=mmap.ACCESS_COPY, offset=start)
        except (OSError, ValueError) as err:  # ValueError: the file is shorter than the map
            raise CheckpointError(f"{info.file} ends inside tensor {as_written(name)} ({err})") from None
        with warnings.catch_warnings():  # the map is private: writes cannot reach the file
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(mapped, dtype=torch.uint8, count=size, offset=info.begin - start)
        if info.begin % dtype.itemsize:  # a misaligned tensor cannot be viewed in its dtype: copy it
            raw = raw.clone()
        return raw.view(dtype).reshape(info.shape)

    def close(self) -> None:
        """Nothing stays open between reads (each map closes with its last view)."""
