"""Counting what a pass dispatches: every torch op that reaches the dispatcher (views included), and
the ones that would make a GPU wait for the host or the host for a GPU (a sync).

A sync is an op that reads a tensor's value on the host (``item()``, ``int()``, ``bool()`` of a
tensor: ``aten.item`` or ``aten.is_nonzero`` under inference mode, ``aten._local_scalar_dense``
outside it; ``tolist()``, ``numpy()``), an op whose output's shape depends
on the values (``nonzero``, ``masked_select``, ``unique``, indexing or writing with a boolean mask,
``repeat_interleave`` by a tensor of counts without ``output_size``), or a copy from a device to the
host. On the CPU none of them waits for anything, but each is where a CUDA pass would stall and
where a CUDA graph could not be captured: counted on the CPU, a pass free of them is ready for both.
"""
import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ_BACK = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")  # a value read on the host (item, int, bool)
VALUE_SHAPED = ("aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique", "aten.masked_scatter")


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    name = str(func.overloadpacket) if hasattr(func, "overloadpacket") else str(func)
    if name in READ_BACK or name.startswith(VALUE_SHAPED):
        return True
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    if name == "aten.repeat_interleave":
        return isinstance(args[0], torch.Tensor) and len(args) < 3 and "output_size" not in kwargs \
            and (len(args) == 1 or isinstance(args[1], torch.Tensor))
    if name in ("aten._to_copy", "aten.copy_", "aten.to"):
        return _device_to_host(func, args, kwargs)
    return False


def _device_to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A copy of a device tensor into host memory."""
    source = args[1] if str(func).startswith("aten.copy_") else args[0]
    target = args[0].device if str(func).startswith("aten.copy_") else kwargs.get("device")
    return isinstance(source, torch.Tensor) and source.device.type != "cpu" and target is not None \
        and torch.device(target).type == "cpu"


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched inside it (``ops``: op name -> count) and the syncs among them
    (``syncs``; ``tolist`` and ``numpy`` of a tensor counted too, as ``Tensor.tolist``/``numpy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self._saved: dict[str, Any] = {}

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        if _is_sync(func, args, kwargs):
            self.syncs[str(func)] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> "OpCounter":
        for name in ("tolist", "numpy"):
            self._saved[name] = original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._reading(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def _reading(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.syncs[f"Tensor.{name}"] += 1
            return original(tensor, *args, **kwargs)
        return read
