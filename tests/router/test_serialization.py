"""Tensors sent as numpy arrays come back bit-identical, whatever their dtype and layout."""
import numpy as np
import pytest
import torch

from hypic.router.serialization import tensor_from_array, tensor_to_array


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_round_trip_is_exact(dtype: torch.dtype) -> None:
    tensor = (torch.randn(3, 5, 7) * 100).to(dtype).transpose(0, 1)  # not contiguous
    back = tensor_from_array(tensor_to_array(tensor))
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_a_read_only_array_is_copied_before_use() -> None:
    name, array = tensor_to_array(torch.arange(6.0))
    array.flags.writeable = False  # as Ray's object store hands it out
    back = tensor_from_array((name, array))
    back += 1  # writable, and the shared buffer is untouched
    assert np.array_equal(array, np.arange(6.0)) and torch.equal(back, torch.arange(6.0) + 1)
